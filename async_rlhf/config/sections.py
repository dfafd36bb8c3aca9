"""The task and training sections of the run configuration (one pydantic model each; rules on the fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_rlhf.config.fields import AboveZero, AtLeastOne, Count, NonNegative, Probability, Section, Share


class ModelConfig(Section):
    path: str = ""
    """A Hugging Face causal-LM directory on disk; empty builds the tiny model (and its SFT warm start)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype on the learner and in vLLM (float32 | bfloat16 | float16)."""
    max_model_len: AtLeastOne = 64
    """Longest prompt + completion, in tokens, that vLLM must hold."""


class TaskConfig(Section):
    name: Literal["addition", "guess_number", "reward_model", "custom", "longtail", "agent"] = "addition"
    """The environment: addition (the tiny verifiable task) | guess_number (multi-turn, a reward per turn) |
    reward_model (addition prompts scored by rewards.model_path) | custom (prompts.* scored by rewards.*) |
    longtail (answers of 1-40 tokens, heavy-tailed: async_rlhf/env/longtail.py) | agent (the user's agent code
    drives episodes through an OpenAI-compatible endpoint: the agent section, docs/agents.md)."""
    max_turns: AtLeastOne = 3
    """Most turns of a multi-turn episode (guess_number)."""
    digits: AtLeastOne = 2
    """Digits per operand of the addition task."""
    heldout_size: AtLeastOne = 200
    """Problems kept out of training for greedy held-out accuracy."""
    sft_steps: Count = 1200
    """Optimizer steps of the SFT warm start of the tiny model (cached on disk)."""
    sft_forget_carry: float = 0.65
    """Share of SFT examples whose target is a sloppy teacher's carry-free sum: the warm start is then right
    on problems without a carry (~27% greedy) and samples the true sum often enough for RL to take over."""
    sft_clean_share: Share = 0.5
    """Share of the SFT steps, at the start, taught by the correct teacher alone; the sloppy teacher mixes in
    after them. The student then knows the carry before it learns to forget it, and RL only has to promote
    it (with 0, the carry was learned on some seeds only and the demo ended at 0.69-0.99: async_rlhf/tiny/sft.py)."""


class RewardsConfig(Section):
    sources: str = "task"
    """Reward sources summed with weights, comma-separated name[:weight]: task (the environment's own rule) |
    function (rewards.function) | model (rewards.model_path) | http (rewards.http_url); e.g. task:1,model:0.5."""
    function: str = ""
    """A Python reward function, module:name or /path/file.py:name, called as fn(prompt, completion, data)."""
    model_path: str = ""
    """Reward model: a Hugging Face sequence-classification directory (num_labels=1), served by Ray actors."""
    model_actors: AtLeastOne = 1
    """Ray actors serving the reward model (requests spread over them)."""
    model_batch_size: AtLeastOne = 64
    """Most texts one reward-model forward scores (concurrent requests are merged up to this)."""
    http_url: str = ""
    """Remote scorer: POST {prompt, completions, data} as JSON, answer {rewards: [...]} (one per completion)."""
    timeout_s: AboveZero = 30.0
    """A reward not computed within this many seconds counts as a timeout; the group is then dropped."""
    max_consecutive_failures: Count = 20
    """Reward failures or timeouts in a row on one generator that stop the run with the source's error
    (0: never; each failed group is dropped and its prompt generated again)."""


class PromptsConfig(Section):
    source: Literal["task", "file", "python", "redis"] = "task"
    """Where prompts come from: task (the environment's own) | file (prompts.path through the datasets
    library) | python (prompts.path names module:function returning an iterable) | redis (a Redis stream)."""
    path: str = ""
    """JSONL or Parquet file (source=file), or module:function / file.py:function (source=python)."""
    text_field: str = "prompt"
    """Field holding the prompt: a string, or chat messages [{"role", "content"}]; the other fields are passed
    to reward functions as data."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """Chat messages through the tokenizer's chat template: auto (messages when it has one) | true (every prompt;
    a template is required) | false (never; messages refused). docs/custom_models.md."""
    eval_path: str = ""
    """Held-out prompts (JSONL or Parquet, fields as prompts.path), generated greedily and scored by
    rewards.sources before, during (generator.eval_every) and after the run: eval/reward_mean, eval/accuracy."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis server of source=redis."""
    stream: str = "async_rlhf:prompts"
    """Redis stream external producers XADD prompts to (field prompts.text_field, other fields are data)."""
    skip_uninformative: bool = False
    """Pre-rollout filtering: a generator passes over a drawn prompt whose last k groups had all-equal rewards
    (they teach nothing under dynamic sampling) with probability 1 - max(prompts.skip_min_retry, 2**-k), and
    generates the next one instead (async_rlhf/generator/prompt_filter.py). For prompt sets that repeat and whose
    solved prompts stay solved; off by default: on our tasks uniform groups are chance, not the prompt's (see
    docs/benchmarks.md)."""
    skip_min_retry: Probability = 0.1
    """Smallest chance that a skipped-before prompt is generated when drawn, so a prompt the policy forgets or
    starts to learn is noticed (1: never skip)."""


class ObjectiveConfig(Section):
    kind: Literal["ppo", "decoupled_ppo", "decoupled_ppo_interp", "tis_token", "tis_seq", "mask_token", "mask_seq",
                  "vtrace"] = "decoupled_ppo"
    """Policy objective: ppo | decoupled_ppo | decoupled_ppo_interp | tis_token | tis_seq | mask_token |
    mask_seq | vtrace."""
    eps_low: float = 0.2
    """Lower clip range of the PPO ratio (1 - eps_low)."""
    eps_high: float = 0.28
    """Upper clip range of the PPO ratio (1 + eps_high); asymmetric clipping when it differs from eps_low."""
    is_cap: float = 5.0
    """Truncation (or upper mask bound) of the behaviour importance weight exp(prox - mu)."""
    is_floor: float = 0.0
    """Lower mask bound of the importance weight (mask_* objectives only)."""
    truncate_mode: Literal["clamp", "mask"] = "clamp"
    """What happens above is_cap in decoupled PPO: clamp (truncate) or mask (drop the token)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """Loss reduction: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO)."""
    kl_coef: NonNegative = 0.0
    """Weight of the KL penalty to the frozen reference model (0 disables the reference)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 | k2 | k3."""


class PPOConfig(Section):
    """PPO with a critic (train.algorithm=ppo): reward models, KL shaping, GAE, the value model."""

    reward_models: str = ""
    """Reward models scoring each completion: comma-separated DIR or DIR:WEIGHT (Hugging Face sequence
    classification directories, num_labels=1, e.g. from python -m async_rlhf.offline.reward_model)."""
    generator_reward_weight: float = 0.0
    """Weight of the reward the generator attached to each sample (its rewards.sources: the task's rule, or a
    reward model served by Ray actors) added to the score of train.ppo.reward_models (scored in the learner).
    With rewards.sources=task this is the verifiable task reward's share of the mix (docs/ppo.md)."""
    reward_model_weight: NonNegative = 1.0
    """Scale of the summed train.ppo.reward_models score in the reward; 0 keeps the reward models as a monitor
    only (rollout/rm_score_mean is still logged)."""
    critic_path: str = ""
    """Causal-LM directory the critic's body starts from (--critic); empty: the policy."""
    critic_lr: AboveZero = 1e-3
    """Learning rate of the critic (AdamW)."""
    value_clip: NonNegative = 0.2
    """Value clipping range around the values the targets were computed with (0 disables)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: NonNegative = 0.05
    """Per-token KL penalty to the frozen reference, in the reward (train.objective.kl_coef puts it in the loss)."""
    reward_norm: bool = True
    """Normalise scores by their running mean and std."""
    reward_clip: NonNegative = 5.0
    """Clip the (normalised) score to [-reward_clip, reward_clip] (0 disables)."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages over the batch's completion tokens."""
    advantage_clip: NonNegative = 5.0
    """Clip the advantages to [-advantage_clip, advantage_clip] (0 disables)."""


class DPOConfig(Section):
    """Online DPO (train.algorithm=online_dpo): pairs = best and worst completion of each prompt group."""

    beta: AboveZero = 0.1
    """DPO temperature: strength of the implicit KL to the reference (the initial policy)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the assumed share of flipped preferences, in [0, 0.5)."""


class LoraConfig(Section):
    """LoRA adapters on the policy through peft (train.lora.enabled): only they train; generators get merged weights."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight (the push sends base + scaled B@A under the base names)."""
    r: int = 16
    """Rank of the adapters."""
    alpha: float = 32.0
    """LoRA alpha: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the linear layers that get adapters (peft's target_modules)."""


class TrainConfig(Section):
    steps: AtLeastOne = 100
    """Learner optimizer steps of the run (the demo's warm start holds >= 0.9 from step 25-50 on every seed of
    bench/seeds.py; past that, dynamic sampling generates many groups per informative one)."""
    max_time_s: NonNegative = 0.0
    """Time budget in seconds from the start of training: then the run stops as on a stop request (the
    learners finish their step, a final checkpoint and summary.json are written); 0: no limit."""
    batch_size: AtLeastOne = 16
    """Prompt groups per learner step (across all learner ranks)."""
    group_size: AtLeastOne = 8
    """Completions sampled per prompt (the GRPO group)."""
    max_staleness: Count = 2
    """Largest version lag a trained token may have; 0 is synchronous on-policy training."""
    lr: AboveZero = 2e-4
    """Learning rate (AdamW)."""
    weight_decay: NonNegative = 0.0
    """AdamW weight decay."""
    grad_clip: AboveZero = 1.0
    """Gradient norm clip."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp."""
    push_every: AtLeastOne = 1
    """Learner steps between weight pushes (one push makes one new version)."""
    minibatches: AtLeastOne = 1
    """Optimizer steps per learner step (the batch is split); with more than one, the proximal policy is
    recomputed at the start of the step (or interpolated, for decoupled_ppo_interp)."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    algorithm: Literal["grpo", "ppo", "online_dpo"] = "grpo"
    """grpo (critic-free, advantages from train.advantage) | ppo (critic, reward models, GAE: train.ppo) |
    online_dpo (pairs from each prompt group: train.dpo)."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    drop_zero_advantage: Literal["auto", "on", "off"] = "auto"
    """Dynamic sampling (DAPO): the buffer drops prompt groups whose rewards are all equal (reason
    zero_advantage: a group baseline makes every advantage zero, so they carry no gradient) and keeps batches
    full with informative ones. on | off | auto (on for grpo with grpo/dr_grpo/rloo advantages and no KL term)."""
