"""The settings of the other commands (data, sft, reward-model, rlhf): dataclasses whose fields are the
commands' flags (cli/flags.py generates them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from auto_research.algorithms.registry import REGISTRY
from auto_research.config.fields import (check_choice, check_device, check_generation_dataset,
                                         check_non_negative_finite, check_positive_finite, check_positive_integers,
                                         comma_list, default_dataset_dir, json_ready, setting)
from auto_research.data.registry import gold_names, task_names, task_record
from auto_research.engine.samplers import VLLM_MEMORY_CPU, VLLM_MEMORY_GPU, served_engines
from auto_research.errors import UserError


@dataclass
class DataConfig:
    """``auto-research data``: download a dataset's official files."""

    name: str = setting("gsm8k", "the dataset: gsm8k", positional=True)
    dataset_dir: Path = setting(default_dataset_dir, "where it goes", default_text="$AUTO_RESEARCH_DATA, else data",
                                type=Path)
    base_url: str | None = setting(None, "mirror of the official files", default_text="OpenAI's repository")

    def validate(self) -> "DataConfig":
        if self.name != "gsm8k":
            raise UserError(f"unknown dataset {self.name!r} for 'data'; choose one of: gsm8k")
        return self


@dataclass
class SFTConfig:
    """``auto-research sft``: supervised fine-tuning of a causal LM on a dataset's demonstrations."""

    output_dir: Path | None = setting(None, "where the fine-tuned model is saved", type=Path, required=True)
    model: str | None = setting(None, "folder or hub id", default_text="a fresh embedded tiny model")
    dataset: str = setting("arithmetic-generate", f"{', '.join(task_names('generation'))} or a .jsonl file")
    prompt_field: str | None = setting(None, "prompt field of a .jsonl dataset", default_text="prompt")
    answer_field: str | None = setting(None, "field of a .jsonl dataset trained on as the completion",
                                       default_text="answer")
    steps: int = setting(1000, "optimizer steps", type=int)
    batch_size: int = setting(64, "demonstrations per step", type=int)
    learning_rate: float = setting(2e-3, "AdamW step size", type=float)
    seed: int = setting(0, "random seed: initialisation and batch order", type=int)
    dataset_dir: Path = setting(default_dataset_dir, "folder holding gsm8k/", default_text="$AUTO_RESEARCH_DATA, else data",
                                type=Path)
    overwrite: bool = setting(False, "replace a model already saved in --output-dir", action="store_true")
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N or mps")
    threads: int | None = setting(None, "CPU threads torch may use", default_text="one per core", type=int)
    chat_template: bool = setting(True, "send prompts as plain text", flag="--no-chat-template", action="store_false")
    offline: bool = setting(False, "never download; a hub id is an error", action="store_true")

    def validate(self) -> "SFTConfig":
        if self.output_dir is None:
            raise UserError("--output-dir is required: where the fine-tuned model is saved")
        check_generation_dataset(self.dataset)
        check_positive_integers(("--steps", self.steps), ("--batch-size", self.batch_size), ("--threads", self.threads))
        check_positive_finite("--learning-rate", self.learning_rate)
        check_device(self.device)
        return self

    def to_json(self) -> dict:
        return json_ready(asdict(self))


@dataclass
class RewardModelConfig:
    """``auto-research reward-model``: a one-scalar reward model fitted to preference pairs (Bradley–Terry)."""

    dataset: str | None = setting(None, "preference pairs: .jsonl, .json, .parquet, .csv, a save_to_disk folder, or "
                                        "a hub name (online)", required=True)
    output_dir: Path | None = setting(None, "where the reward model is saved", type=Path, required=True)
    model: str | None = setting(None, "causal LM folder or hub id to put the head on",
                                default_text="a fresh embedded tiny model")
    prompt_field: str = setting("prompt", "the prompt's field ('none': the prompt is inside chosen and rejected)")
    chosen_field: str = setting("chosen", "the preferred response's field")
    rejected_field: str = setting("rejected", "the other response's field")
    margin_field: str | None = setting(None, "a per-pair margin m in −log σ(r_w − r_l − m)", default_text="none")
    center_rewards_coefficient: float = setting(0.0, "weight of (r_w + r_l)², keeping rewards near 0", type=float)
    steps: int = setting(400, "optimizer steps", type=int)
    batch_size: int = setting(32, "pairs per step", type=int)
    learning_rate: float = setting(1e-3, "AdamW step size", type=float)
    max_length: int | None = setting(None, "truncate prompt + response to N tokens", type=int)
    evaluation_examples: int | None = setting(None, "held-out pairs", default_text="min(500, pairs // 10), at least 1",
                                              type=int)
    seed: int = setting(0, "random seed", type=int)
    overwrite: bool = setting(False, "replace a model already saved in --output-dir", action="store_true")
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N or mps")
    offline: bool = setting(False, "never download", action="store_true")
    progress: bool = setting(True, "no progress bar", flag="--no-progress", action="store_false")

    @property
    def prompt(self) -> str | None:
        return None if self.prompt_field in (None, "", "none") else self.prompt_field

    def validate(self) -> "RewardModelConfig":
        for flag, value in (("--dataset", self.dataset), ("--output-dir", self.output_dir)):
            if value is None:
                raise UserError(f"{flag} is required")
        check_positive_integers(("--steps", self.steps), ("--batch-size", self.batch_size),
                                ("--evaluation-examples", self.evaluation_examples), ("--max-length", self.max_length))
        check_positive_finite("--learning-rate", self.learning_rate)
        check_non_negative_finite("--center-rewards-coefficient", self.center_rewards_coefficient)
        check_device(self.device)
        return self


@dataclass
class RLHFConfig:
    """``auto-research rlhf``: the whole RLHF pipeline on an embedded preference task."""

    model: str | None = setting(None, "starting policy and reward-model backbone",
                                default_text="the embedded tiny model, warm-started on arithmetic")
    gold: str = setting("length", "the hidden gold scorer, and with it the preference task: " + "; ".join(
        f"{gold} ({name}: {task_record(name).gold_about})" for gold, name in gold_names().items()),
                        choices=tuple(gold_names()))
    algorithms: str = setting("rloo", "comma-separated")
    betas: str = setting("0.05", "comma-separated β values: a sweep")
    seeds: str = setting("42", "comma-separated")
    group_size: int = setting(4, "K", type=int)
    steps: int | None = setting(None, "RL steps per run", default_text="the dataset's, 300", type=int)
    pairs: int = setting(3000, "preference pairs to label", type=int)
    reward_model_steps: int = setting(400, "optimizer steps of the reward model", type=int)
    eval_every: int | None = setting(None, "evaluations for the KL curves", default_text="50", type=int)
    output_dir: Path = setting(lambda: Path("runs/rlhf"), "where the pipeline's outputs go", type=Path)
    overwrite: bool = setting(False, "start afresh over an earlier pipeline in --output-dir", action="store_true")
    progress: bool = setting(True, "no progress bars", flag="--no-progress", action="store_false")

    @property
    def dataset(self) -> str:
        return gold_names()[self.gold]

    def validate(self) -> "RLHFConfig":
        unknown = [name for name in self.algorithm_list() if name not in REGISTRY]
        if unknown:
            raise UserError(f"--algorithms {self.algorithms!r}: choose from {', '.join(REGISTRY)}")
        check_choice("--gold", self.gold, tuple(gold_names()))
        for beta in self.beta_list():
            check_non_negative_finite("--betas", beta)
        self.seed_list()
        check_positive_integers(("--pairs", self.pairs), ("--reward-model-steps", self.reward_model_steps),
                                ("--steps", self.steps), ("--eval-every", self.eval_every))
        if self.group_size < 2:
            raise UserError(f"--group-size {self.group_size}: K >= 2")
        return self

    def algorithm_list(self) -> list[str]:
        return comma_list("--algorithms", self.algorithms, noun="algorithm")

    def beta_list(self) -> list[float]:
        return comma_list("--betas", self.betas, float, "β")

    def seed_list(self) -> list[int]:
        return comma_list("--seeds", self.seeds, int, "seed")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's choices of ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``, 0.32)."""


@dataclass
class ServeConfig:
    """``auto-research rollout-serve`` (alias ``vllm-serve``): one rollout engine behind an HTTP port, for
    ``--rollout-mode server``."""

    engine: str = setting("vllm", f"the rollout engine: {' or '.join(served_engines())} (builtin: the trainer's own "
                                  "sampler in a process of its own, no vLLM needed)")

    model: str | None = setting(None, "folder, hub id, .gguf or packaged name (the trainer pushes its weights at "
                                      "its start and after every step, so only the architecture and tokenizer "
                                      "must match)", default_text="the embedded tiny model")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on (0: any free one, printed)", type=int)
    rollout_memory: float | None = setting(None, "on a GPU, the share of its memory vLLM may take; on the CPU, the "
                                                 "share of host memory for its KV cache",
                                           default_text=f"{VLLM_MEMORY_GPU} GPU, {VLLM_MEMORY_CPU} CPU",
                                           flag="--rollout-memory", aliases=("--vllm-memory",), type=float)
    max_model_len: int | None = setting(None, "longest prompt + completion served",
                                        default_text="the model's context, at most 4096", type=int)
    dtype: str = setting("auto", "auto (bf16 on CUDA, else fp32), bfloat16 or float32")
    device: str = setting("auto", "auto (CUDA when present) or cpu")
    seed: int = setting(0, "the engine's seed (each request carries its own seeds)", type=int)
    threads: int | None = setting(None, "CPU threads torch may use", default_text="one per core", type=int)
    offline: bool = setting(False, "never download; a hub id is an error", action="store_true")
    api_key_file: str | None = setting(None, "a file (mode 0600) holding the shared secret every request must carry "
                                             "(Authorization: Bearer KEY; 16 to 256 printable ASCII characters); the "
                                             "trainer reads it from AUTO_RESEARCH_API_KEY",
                                       default_text="$AUTO_RESEARCH_API_KEY, else none")
    lease_seconds: float = setting(60.0, "a trainer's lease lapses this long after its last renewal (its pushes "
                                         "and a heartbeat every quarter of it renew it), freeing the server of a "
                                         "trainer that died", type=float)
    read_timeout: float = setting(30.0, "seconds a connection may take to send its request", type=float)
    max_group_size: int = setting(256, "most completions per prompt one request may ask for", type=int)
    max_request_tokens: int = setting(2**20, "most tokens one /generate may ask for: over its prompts, group size "
                                             "× (prompt + max new tokens) (the trainer splits its requests to fit)",
                                      type=int)
    max_server_tokens: int = setting(2**22, "most tokens the /generate requests of clients without the lease may "
                                            "hold at once (the lease holder's always go in, and first)", type=int)
    tensor_parallel_size: int = setting(1, "vLLM's tensor parallelism: the model split over this many GPUs (on the "
                                           "CPU, over this many groups of this process's cores)", type=int)
    enable_lora: bool = setting(False, "vLLM applies a LoRA run's pushed adapter itself: after the base weights "
                                       "once, each push is the adapter alone (the builtin engine always takes "
                                       "adapters)", action="store_true")
    max_lora_rank: int = setting(16, "with --enable-lora, the largest adapter rank vLLM makes room for: 1, 8, 16, "
                                     "32, 64, 128, 256, 320 or 512 (vLLM's choices)", type=int)
    data_parallel_size: int = setting(1, "vLLM's data parallelism: this many copies of the model, passed through to "
                                         "vLLM (one line where the installed vLLM cannot; several servers behind one "
                                         "trainer are the other way, docs/scaling-out.md)", type=int)

    def _check_builtin(self) -> None:
        """vLLM's settings, refused for the builtin engine with what it does instead."""
        float32 = "the builtin engine samples in float32 with the model's own cache, as the trainer does"
        one_device = ("the builtin engine runs on one device (several servers behind one trainer spread its groups: "
                      "docs/scaling-out.md)")
        for flag, given, why in (("--rollout-memory", self.rollout_memory is not None, float32),
                                 ("--dtype", self.dtype != "auto", float32),
                                 ("--tensor-parallel-size", self.tensor_parallel_size != 1, one_device),
                                 ("--data-parallel-size", self.data_parallel_size != 1, one_device),
                                 ("--enable-lora", self.enable_lora, "the builtin engine always takes a LoRA run's "
                                                                     "adapter alone")):
            if given:
                raise UserError(f"{flag} is vLLM's (--engine vllm); {why}")

    def validate(self) -> "ServeConfig":
        from auto_research.engine.sources import require_vllm

        if self.engine not in served_engines():
            raise UserError(f"--engine must be {' or '.join(served_engines())}, got {self.engine!r}")
        if self.engine == "vllm":
            require_vllm()
        else:
            self._check_builtin()
        if self.max_lora_rank not in LORA_RANKS:
            raise UserError(f"--max-lora-rank must be one of vLLM's {', '.join(map(str, LORA_RANKS))}, got "
                            f"{self.max_lora_rank}")
        if not 0 <= self.port < 65536:
            raise UserError(f"--port must be in 0..65535, got {self.port}")
        if self.rollout_memory is not None and not (0 < self.rollout_memory <= 1):
            raise UserError(f"--rollout-memory must be in (0, 1], got {self.rollout_memory}")
        check_positive_integers(("--max-model-len", self.max_model_len), ("--threads", self.threads),
                                ("--max-group-size", self.max_group_size),
                                ("--max-request-tokens", self.max_request_tokens),
                                ("--max-server-tokens", self.max_server_tokens),
                                ("--tensor-parallel-size", self.tensor_parallel_size),
                                ("--data-parallel-size", self.data_parallel_size))
        if self.max_server_tokens < self.max_request_tokens:
            raise UserError(f"--max-server-tokens {self.max_server_tokens} is below --max-request-tokens "
                            f"{self.max_request_tokens}: a request allowed alone could never go in")
        check_positive_finite("--lease-seconds", self.lease_seconds)
        check_positive_finite("--read-timeout", self.read_timeout)
        check_device(self.device)
        if self.dtype not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
            raise UserError(f"--dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        return self
