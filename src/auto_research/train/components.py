"""A generation-level run's frozen values, built once (``build_components``): ``RunContext``, ``Models``, ``Drawing``.
Weights and optimizer states are float32 (master weights); ``--dtype bfloat16`` runs forwards under bf16 autocast."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.utils.checkpoint

from auto_research.algorithms.registry import Algorithm, get_algorithm
from auto_research.config.generation import GenerationConfig
from auto_research.config.loss import LossSection, served
from auto_research.config.sampling import OptimisationSection, SamplingSection
from auto_research.config.sections import LoraSection, PolicySection
from auto_research.data.types import Task
from auto_research.engine import checkpoint as checkpoints
from auto_research.engine import lora
from auto_research.engine.distributed import World, decoder_layers
from auto_research.engine.embedding import tied_rows_gradient
from auto_research.engine.logprobs import CACHE_NAMES
from auto_research.engine.machine import set_threads
from auto_research.engine.offload import OffloadedReference
from auto_research.engine.packaged import cache_dir
from auto_research.engine.models import (context_length, format_prompt, load_critic, load_policy, load_tokenizer,
                                         resolve_device, resolve_dtype)
from auto_research.engine.rollout import Sampler, SamplingSettings
from auto_research.engine.samplers import SamplerNeeds, SamplerRecord, sampler_record
from auto_research.errors import UserError
from auto_research.rewards.combine import CombinedReward, build_reward
from auto_research.train.prepare import Prepared
from auto_research.train.signals import OUTSIDE, Loading


@dataclass(frozen=True)
class RunContext:
    """Who runs, on what, with which settings (``config``: the whole run's, whose sections the phases read)."""

    config: GenerationConfig
    world: World
    device: str
    compute_dtype: torch.dtype
    algorithm: Algorithm
    task: Task
    tokenizer: object
    model_name: str
    engine: SamplerRecord
    python_rewards: tuple = ()
    """The rewards given from Python, as config.yaml names them (``Prepared.python_rewards``)."""

    def autocast(self):
        return autocast_for(self.device, self.compute_dtype)

    def sampling(self, policy):
        """What decoding from ``policy`` (and other models) is done inside (``sampling_context``)."""
        return sampling_context(self.world, policy, self.device, self.compute_dtype)

    @property
    def updates_per_step(self) -> int:
        return self.config.loss.updates_per_batch * self.config.loss.ppo_mini_batches


@dataclass(frozen=True)
class Models:
    """The trainer side: the policy and PPO's critic with their optimizers, the frozen reference."""

    policy: torch.nn.Module
    """The model that trains (a PEFT model with LoRA); its weights are what a checkpoint holds."""
    train_policy: torch.nn.Module
    """What gradient forwards call: the DDP wrapper, or the model itself (one process, FSDP)."""
    optimizer: torch.optim.Optimizer
    reference: Callable | None
    """The frozen reference: a model, the policy with its LoRA adapters off, or None (not needed)."""
    critic: torch.nn.Module | None = None
    train_critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    offloaded_reference: OffloadedReference | None = None
    """The reference's weights out of the process between its passes (--offload-reference), else None."""

    @contextlib.contextmanager
    def reference_in_use(self):
        """Around every pass of the reference (yielded, None without one): with --offload-reference its weights
        come back for the pass and leave after it."""
        if self.offloaded_reference is None:
            yield self.reference
            return
        model = self.offloaded_reference.fetch()
        try:
            yield model
        finally:
            self.offloaded_reference.release()


@dataclass(frozen=True)
class Drawing:
    """What the rollout side (``schedule.rollout_source``) and the held-out evaluations draw and score with."""

    sampler: Sampler
    reward: CombinedReward
    judge: Callable | None
    train_prompts: list[str]
    eval_prompts: list[str]
    episodes: object | None = None
    """Multi-turn trajectories with --environment/--tools (envs.rollout.EpisodeRunner), or --rollout-function's
    (envs.custom.FunctionRunner), else None."""
    outside: dict = field(default_factory=dict)
    """Stream name → what its signal from outside scores with (``signals``: --teacher-model's teachers by name)."""


def autocast_for(device: str, compute_dtype: torch.dtype):
    """bf16 compute over float32 master weights when the compute dtype is bf16; nothing otherwise."""
    if compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=compute_dtype)


def sampling_context(world: World, policy, device: str, compute_dtype: torch.dtype):
    """What decoding from ``policy`` (and other models) is done inside: autocast, and whole parameters under FSDP."""
    @contextlib.contextmanager
    def sampling(*models):
        with autocast_for(device, compute_dtype), world.gathered(policy, *models):
            yield
    return sampling


def adamw(model, optimisation: OptimisationSection) -> torch.optim.AdamW:
    """AdamW over the weights that train: fused wherever torch has the kernel for their device (no temporary the
    size of the model; on this CPU about 5× faster than foreach), else foreach (FSDP's DTensors)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415
    from torch.optim.optimizer import _get_fused_kernels_supported_devices  # noqa: PLC0415

    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    fused = all(not isinstance(p, DTensor) and p.device.type in _get_fused_kernels_supported_devices()
                and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for p in trainable)
    return torch.optim.AdamW(trainable, lr=optimisation.learning_rate, weight_decay=optimisation.weight_decay,
                             **({"fused": True} if fused else {"foreach": True}))


def _load_optimizer(world: World, model, optimizer, folder: Path) -> None:
    saved = checkpoints.read_optimizer_state(folder)
    if all(isinstance(key, int) for key in saved["state"]):  # a checkpoint from before names
        optimizer.load_state_dict(saved)
    else:
        world.load_optimizer_state(model, optimizer, saved)


def recompute_in_backward(modules, kind: str) -> int:
    """Wrap each module's forward in non-reentrant torch.utils.checkpoint when gradients are taken (same numbers).
    Unlike transformers' own, it works in eval mode (the policy trains in it); a forward given a KV cache runs as it
    is (the recompute would extend the cache twice). ``kind`` is kept as ``recomputed_in_backward``. Returns the
    count."""
    wrapped = 0
    for module in modules:
        forward = module.forward

        def recomputed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled() or any(kwargs.get(name) is not None for name in CACHE_NAMES):
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = recomputed
        module.recomputed_in_backward = kind
        wrapped += 1
    return wrapped


def checkpoint_mlps(model) -> int:
    """Recompute every decoder layer's MLP in the backward (its gate, up and activation products are not kept)."""
    mlps = [layer.mlp for layer in decoder_layers(model) if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
    if not mlps:
        raise UserError("--checkpoint-mlp: this model's decoder layers have no mlp module to recompute")
    return recompute_in_backward(mlps, "mlp")


def checkpoint_layers(model) -> int:
    """Recompute every decoder layer in the backward (--gradient-checkpointing). Returns the layers wrapped."""
    layers = decoder_layers(model)
    if not layers:
        raise UserError("--gradient-checkpointing: this model has no list of decoder layers to recompute")
    return recompute_in_backward(layers, "layer")


def recompute(model, optimisation: OptimisationSection) -> None:
    """--checkpoint-mlp and --gradient-checkpointing on a model that trains (the policy, PPO's critic)."""
    if optimisation.checkpoint_mlp:
        checkpoint_mlps(model)
    if optimisation.gradient_checkpointing:
        checkpoint_layers(model)


def _check_context(model, tokenizer, prompts: list[str], max_new_tokens: int) -> None:
    limit = context_length(model)
    if limit is not None:
        longest = max(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts)
        if longest + max_new_tokens > limit:
            raise UserError(f"prompts of up to {longest} tokens plus --max-new-tokens {max_new_tokens} "
                            f"exceed the model's context of {limit} tokens")


def build_components(prepared: Prepared, model_name: str, world: World, log=print):
    """The run's context, trainer side and drawing side: every model loaded once, resumed, and wrapped (DDP, FSDP2)."""
    config, task, resume_from = prepared.config, prepared.task, prepared.resume_from
    algorithm, offline, lora_r = get_algorithm(config.run.algorithm), config.data.offline, bool(config.lora.lora_r)
    device, compute_dtype = _start(config.policy, config.run.seed, world)
    if config.logging.shows_progress:
        log(f"loading the model {config.policy.model or model_name} on {device}"
            + (f", with the weights of {resume_from}" if resume_from is not None else ""))
    _check_tokenizers(config.loss, offline, model_name, log)
    record = sampler_record(config.rollout)  # the policy in float32 (the master weights) and its sampler's record
    policy, tokenizer = load_policy(model_name, device, torch.float32, offline, log=log, keep_adapter=lora_r)
    if record.check_model is not None:  # a sampler that cannot serve this model says so before anything else loads
        record.check_model(getattr(policy, "get_base_model", lambda: policy)().config, device, model_name)
    recompute(policy, config.optimisation)
    policy, reference = _reference(config.loss, config.lora, offline, task, policy, model_name, device, compute_dtype)
    loading = Loading(offline, device, compute_dtype, world, tokenizer, log)
    outside = {name: held for name, signal in OUTSIDE.items()
               if (held := signal.build(getattr(config, signal.section), loading))}
    rewards = config.rewards
    critic = (_load_critic(config.critic.critic_model, rewards.reward_model, config.optimisation, offline, model_name,
                           device, len(tokenizer)) if algorithm.needs_critic else None)
    reward = (CombinedReward([], []) if task.verifier is None and not prepared.rewards and not rewards.reward_model
              else build_reward(prepared.rewards, rewards.reward_weights, rewards.reward_model, task.verifier, device,
                                offline))  # (none: the algorithm takes no task reward, data/tasks.py)
    train_prompts = _formatted(tokenizer, task.train, config.data.chat_template)
    eval_prompts = _formatted(tokenizer, task.evaluation, config.data.chat_template)
    _check_context(policy, tokenizer, train_prompts + eval_prompts, config.sampling.max_new_tokens)
    if resume_from is not None:
        _resume_weights(resume_from, lora_r, policy, critic)
    train_policy = world.wrap(policy)
    tied_rows_gradient(policy)  # after DDP's wrap (see there)
    offloaded = _wrap_reference(lora_r, config.optimisation.offload_reference, world, reference, log)
    optimizer, train_critic, critic_optimizer = _optimizers(config.optimisation, world, policy, train_policy, critic,
                                                            resume_from)
    sampler = record.build(SamplerNeeds(
        config.rollout, policy, tokenizer, sampling_settings(config.sampling),
        chunk_prompts(config.sampling, config.optimisation), sampling_context(world, policy, device, compute_dtype),
        model_name, world, compute_dtype, device, train_prompts, config.run.seed, config.run_dir,
        config.policy.threads, config.engine_tokens(prepared.multi_turn), log))
    episodes = _episodes(prepared, algorithm, tokenizer, policy, sampler, model_name, task)
    return (RunContext(config, world, device, compute_dtype, algorithm, task, tokenizer, model_name, record,
                       prepared.python_rewards),
            Models(policy, train_policy, optimizer, reference, critic, train_critic, critic_optimizer, offloaded),
            Drawing(sampler, reward, prepared.judge, train_prompts, eval_prompts, episodes, outside))


def _start(policy: PolicySection, seed: int, world: World) -> tuple[str, torch.dtype]:
    """The process's threads and seed (set before any model loads, so a freshly initialised head is the same on
    every run), its device, its process group started, and the compute dtype on that device."""
    set_threads(policy.threads)
    torch.manual_seed(seed)
    device = world.device(resolve_device(policy.device))
    world.start(device)
    return device, resolve_dtype(policy.dtype, device)


def _reference(loss: LossSection, lora_section: LoraSection, offline: bool, task: Task, policy, model_name: str,
               device: str, compute_dtype):
    """The policy (with adapters under LoRA) and the frozen reference: the policy with its adapters off under LoRA,
    else --reference-model (default a copy of the policy) in the compute dtype; None when β = 0 and no gold scorer."""
    measured = loss.beta > 0 or task.gold is not None
    if lora_section.lora_r:
        policy, reference = lora.add_adapters(policy, lora_section, model_name)
        return policy, reference if measured else None
    if not measured:
        return policy, None
    return policy, load_policy(loss.reference_model or model_name, device, compute_dtype, offline,
                               flag="--reference-model")[0].eval().requires_grad_(False)


def _check_tokenizers(loss: LossSection, offline: bool, model_name: str, log) -> None:
    """--reference-model and --teacher-model score the policy's token ids: one whose tokenizer is not the policy's is
    refused in one line that names both (and a token they differ on), before any weights load."""
    ours = None
    for name, flag in ((loss.reference_model, "--reference-model"),
                       *((teacher, "--teacher-model") for teacher in loss.teachers.values())):
        if name not in (None, model_name) and not served(name):  # a served teacher's server checks its own
            ours = ours or load_tokenizer(model_name, offline, log)[0].get_vocab()
            theirs = load_tokenizer(name, offline, log, flag)[0].get_vocab()
            differ = sorted(token for token in theirs.keys() | ours.keys() if theirs.get(token) != ours.get(token))
            if differ:
                raise UserError(f"{flag} {name}: its tokenizer is not the policy's ({model_name}): " + (
                    f"{len(theirs)} tokens, the policy's {len(ours)}" if len(theirs) != len(ours) else
                    f"{differ[0]!r} is id {theirs[differ[0]]} there, {ours[differ[0]]} in the policy's")
                                + "; it must score the policy's own token ids")


def _load_critic(critic_model: str | None, reward_model: str | None, optimisation: OptimisationSection,
                 offline: bool, model_name: str, device: str, vocabulary: int):
    """PPO's critic, from --critic-model, else the reward model, else the policy's checkpoint."""
    source, flag = ((critic_model, "--critic-model") if critic_model else
                    (reward_model, "--reward-model (the critic's default start)") if reward_model
                    else (model_name, "--model"))
    critic = load_critic(source, device, offline, vocabulary, flag)
    recompute(critic, optimisation)
    return critic


def _formatted(tokenizer, examples, chat_template) -> list[str]:
    return [format_prompt(tokenizer, example.messages or example.prompt, chat_template) for example in examples]


def _resume_weights(folder: Path, lora_r: bool, policy, critic) -> None:
    """The checkpoint's weights into the policy (its adapters alone under LoRA) and the critic, before wrapping."""
    if lora_r:
        lora.load_adapter_weights(folder, policy)
    else:
        checkpoints.load_weights(folder, policy)
    if critic is not None:
        checkpoints.load_weights(folder / "critic", critic)


def _wrap_reference(lora_r: bool, offload: bool, world: World, reference, log) -> OffloadedReference | None:
    """A reference of its own wrapped and, with --offload-reference, offloaded (returned), else None."""
    if reference is not None and not lora_r:
        world.wrap(reference, trains=False)
        if offload:
            return OffloadedReference(reference, cache_dir() / "offload")
    elif offload and not lora_r:
        log("note: --offload-reference has nothing to offload: with --beta 0 no reference is held")
    return None


def _optimizers(optimisation: OptimisationSection, world: World, policy, train_policy, critic,
                resume_from: Path | None):
    """The policy's optimizer, the critic wrapped and its optimizer (None, None without one), resumed states in."""
    optimizer = adamw(policy, optimisation)
    train_critic = critic_optimizer = None
    if critic is not None:
        train_critic, critic_optimizer = world.wrap(critic), adamw(critic, optimisation)
    if resume_from is not None:
        _load_optimizer(world, train_policy, optimizer, resume_from)
        if critic is not None:
            _load_optimizer(world, train_critic, critic_optimizer, resume_from / "critic")
    return optimizer, train_critic, critic_optimizer


def _episodes(prepared: Prepared, algorithm: Algorithm, tokenizer, policy, sampler, model_name: str, task: Task):
    """The multi-turn runner (--environment/--tools', or --rollout-function's) over the sampler; None for one turn."""
    config = prepared.config
    scores_replies = bool(prepared.rewards or config.rewards.reward_model)
    episodes = None
    if prepared.environment is not None or prepared.tools:
        from auto_research.engine.rollout import eos_ids  # noqa: PLC0415
        from auto_research.envs.rollout import row_of, runner_for  # noqa: PLC0415

        episodes = runner_for(config.turns, config.sampling, algorithm, prepared.environment, prepared.tools or {},
                              tokenizer, eos_ids(tokenizer, policy), sampler, model_name, row_of(task.train[0]),
                              scores_replies or prepared.environment is None)
    if prepared.rollout_function is not None:
        from auto_research.envs.custom import function_runner  # noqa: PLC0415

        episodes = function_runner(prepared, tokenizer, policy, sampler, sampling_settings(config.sampling),
                                   config.trajectory_tokens(True), scores_replies)
    return episodes


def sampling_settings(sampling: SamplingSection) -> SamplingSettings:
    return SamplingSettings(sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k)


def chunk_prompts(sampling: SamplingSection, optimisation: OptimisationSection) -> int | None:
    """Prompts per sampling chunk, from --generation-batch-size (else --micro-batch-size) completions: the same
    chunks on 1 or N processes, hence the same floating-point numbers."""
    per_call = sampling.generation_batch_size or optimisation.micro_batch_size
    return max(1, per_call // sampling.group_size) if per_call else None


def parameter_counts(models: Models, drawing: Drawing, lora_r: int) -> dict:
    """Trainable and total parameters of every model held: policy, critic, reference, reward model."""
    def count(model):
        return sum(parameter.numel() for parameter in model.parameters()) if model is not None else 0

    def trainable(model):
        return sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else 0

    reward_model = drawing.reward.reward_model
    # With LoRA the reference is the policy with its adapters off: no weights of its own.
    reference = None if lora_r else models.reference
    held = {"policy": count(models.policy), "critic": count(models.critic), "reference": count(reference),
            "reward_model": count(reward_model.model if reward_model is not None else None),
            **{label: count(model) for name, held in drawing.outside.items()
               for label, model in OUTSIDE[name].held(held).items()}}
    return {**held, "trainable": trainable(models.policy) + trainable(models.critic), "total": sum(held.values())}
