"""The model's configuration (``ModelConfig``) and its shape rules under tensor parallelism.

Flag names, meanings and defaults are Megatron-LM's: the GPT-2 architecture by default
(LayerNorm, exact GELU, learned absolute positions, tied embeddings, biases), and the
options a Llama-style decoder needs (``--normalization RMSNorm``, ``--position-embedding-type
rope``, ``--swiglu``, ``--group-query-attention --num-query-groups``, ``--kv-channels``,
``--untie-embeddings-and-output-weights``, ``--disable-bias-linear``, ``--apply-layernorm-1p``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError, config_field as _f

__all__ = ["ModelConfig", "check_model_shape", "check_fusion_flags", "fusion_notes", "NORMALIZATIONS", "POSITION_EMBEDDING_TYPES",
           "ATTENTION_BACKENDS", "KERNEL_FIELDS"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
#: Megatron-LM's ``AttnBackend`` values (megatron/core/transformer/enums.py)
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
#: fields that choose kernels, not the model: a checkpoint's model is the same whatever they were
KERNEL_FIELDS = ("bias_gelu_fusion", "bias_swiglu_fusion", "apply_rope_fusion", "masked_softmax_fusion",
                 "bias_dropout_fusion", "cross_entropy_loss_fusion", "attention_backend")


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron's default MLP width with SwiGLU: 2/3 of 4·h (three matrices instead of two), a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


@dataclass
class ModelConfig:
    """Shape and architecture of the GPT (Megatron-LM's model flags)."""

    num_layers: int = _f(4, "number of Transformer layers")
    hidden_size: int = _f(256, "hidden size h")
    num_attention_heads: int = _f(4, "attention heads (divisible by tp)")
    ffn_hidden_size: int | None = _f(None, "MLP inner size (default 4·h; with --swiglu 2/3 of that, a multiple of 64)")
    seq_length: int = _f(256, "tokens per sample")
    max_position_embeddings: int | None = _f(None, "learned positions (default seq-length)")
    vocab_size: int | None = _f(None, "vocabulary size (default: the tokenizer's; required with --mock-data)")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this × tp")
    hidden_dropout: float = _f(0.1, "dropout on hidden states (0 makes runs comparable across layouts)")
    attention_dropout: float = _f(0.1, "dropout on attention probabilities")
    init_method_std: float = _f(0.02, "standard deviation of the normal weight initialisation")
    normalization: str = _f("LayerNorm", "normalization of the blocks and the final norm", choices=NORMALIZATIONS)
    norm_epsilon: float = _f(1e-5, "epsilon of LayerNorm and RMSNorm")
    apply_layernorm_1p: bool = _f(False, "zero-centred norm scale (LayerNorm and RMSNorm): the weight holds gamma "
                                         "− 1, starts at zero, and the norm multiplies by weight + 1")
    position_embedding_type: str = _f("learned_absolute", "learned_absolute: a learned table added to the word "
                                      "embedding; rope: rotary embeddings on queries and keys; none",
                                      choices=POSITION_EMBEDDING_TYPES)
    rotary_base: float = _f(10000.0, "base of the rotary embeddings' frequencies (theta)")
    rotary_percent: float = _f(1.0, "fraction of each head's channels that rotary embeddings rotate")
    swiglu: bool = _f(False, "gated MLP: silu(x W_gate) * (x W_up), then W_down (instead of GELU)")
    openai_gelu: bool = _f(False, "GPT-2's tanh approximation of GELU (default: the exact erf GELU)")
    group_query_attention: bool = _f(False, "grouped-query attention: --num-query-groups key/value heads")
    num_query_groups: int = _f(1, "key/value heads with --group-query-attention (divides the heads and by tp)")
    kv_channels: int | None = _f(None, "channels per attention head (default hidden-size / num-attention-heads)")
    untie_embeddings_and_output_weights: bool = _f(False, "the output layer has its own weight (default: the word "
                                                          "embedding's)")
    disable_bias_linear: bool = _f(False, "no biases in the attention and MLP linear layers")
    add_qkv_bias: bool = _f(False, "a bias in the query/key/value projection even with --disable-bias-linear")
    qk_layernorm: bool = _f(False, "normalize every head's queries and keys (--normalization, over the head's "
                                   "channels, one weight per q and k shared by the heads) before the rotary "
                                   "embeddings (Megatron-Core's q_layernorm / k_layernorm; Qwen3's q_norm / k_norm)")
    # kernel choices (Megatron-LM's flags and defaults). A fusion is what --torch-compile fuses: turned off, its
    # element-wise chain runs outside the compiled region, op by op (models/fusion.py)
    bias_gelu_fusion: bool = _f(True, "fuse the MLP's fc1 bias and GELU in the compiled layer (off: run them op by "
                                      "op, outside it)", flag="--no-bias-gelu-fusion")
    bias_swiglu_fusion: bool = _f(True, "fuse SwiGLU's gating (silu(gate) · up) in the compiled layer (off: op by "
                                        "op, outside it)", flag="--no-bias-swiglu-fusion")
    apply_rope_fusion: bool = _f(True, "fuse the rotary embedding of queries and keys in the compiled layer (off: op "
                                       "by op, outside it)", flag="--no-rope-fusion")
    masked_softmax_fusion: bool = _f(True, "fuse the scaling, causal mask and softmax of the unfused/local attention "
                                           "in the compiled layer (off: op by op, outside it)",
                                     flag="--no-masked-softmax-fusion")
    bias_dropout_fusion: bool = _f(True, "fuse the dropout and residual add after the attention and the MLP in the "
                                         "compiled layer (off: op by op, outside it)", flag="--no-bias-dropout-fusion")
    cross_entropy_loss_fusion: bool = _f(False, "fused vocabulary-parallel cross-entropy: chunked over tokens, it "
                                                "never holds fp32 logits of the whole vocabulary (its chunks are "
                                                "compiled with --torch-compile)")
    attention_backend: str = _f("auto", "attention kernel: flash (FlashAttention), fused (cuDNN), unfused or local "
                                        "(softmax(QKᵀ)V written out, no fused kernel), auto (CUDA: the fastest "
                                        "measured at start-up; CPU: PyTorch's own choice)", choices=ATTENTION_BACKENDS)

    # mixture of experts (Megatron-LM's flags, names and defaults; models/moe). num_experts None: every MLP is dense.
    # Expert parallelism: --expert-model-parallel-size / --expert-tensor-parallel-size (ParallelConfig)
    num_experts: int | None = _f(None, "experts per MoE layer (None: no MoE layer, every MLP dense)")
    moe_layer_freq: int | str = _f(1, "which layers are MoE: every N-th (layer i when i mod N is 0), or a 0/1 pattern "
                                      "per layer, e.g. [1,0,1,0] or ([1]*3+[0])*2")
    moe_ffn_hidden_size: int | None = _f(None, "width of each expert's MLP (default: --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: int | None = _f(None, "width of the shared experts' MLP, run on every token "
                                                               "beside the routed ones (None: no shared experts)")
    moe_router_topk: int = _f(2, "experts each token is routed to (k)")
    moe_router_score_function: str = _f("softmax", "router score: softmax or sigmoid",
                                        choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = _f(False, "softmax over all experts before top-k (default: top-k of the logits, "
                                             "then softmax over the k)")
    moe_router_load_balancing_type: str = _f("aux_loss", "load balancing: aux_loss (Switch Transformer's, over the "
                                                         "micro-batch), seq_aux_loss (per sequence), none",
                                             choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = _f(0.0, "coefficient of the load-balancing loss (0: none)")
    moe_z_loss_coeff: float | None = _f(None, "coefficient of the router z-loss (ST-MoE; None: none)")
    moe_expert_capacity_factor: float | None = _f(None, "expert capacity = ceil(tokens·k / experts · factor); tokens "
                                                        "over it are dropped (None: dropless)")
    moe_token_drop_policy: str = _f("probs", "which tokens an expert over capacity drops: probs (the lowest "
                                             "probabilities) or position (the latest in the micro-batch)",
                                    choices=("probs", "position"))
    moe_pad_expert_input_to_capacity: bool = _f(False, "pad every expert's input to its capacity (needs "
                                                       "--moe-expert-capacity-factor)")
    moe_token_dispatcher_type: str = _f("allgather", "token dispatch over the expert-parallel ranks: allgather or "
                                                     "alltoall", choices=("allgather", "alltoall"))
    moe_grouped_gemm: bool = _f(False, "run a rank's experts as one grouped GEMM per matrix (torch._grouped_mm; "
                                       "rows of 16-byte multiples); off: one GEMM per expert")

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = swiglu_ffn_hidden_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    # ---- derived ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, or ``hidden_size // num_attention_heads``."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups`` with grouped-query attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def add_bias_linear(self) -> bool:
        """Whether the attention and MLP linear layers have biases (Megatron's ``add_bias_linear``)."""
        return not self.disable_bias_linear

    @property
    def qkv_bias(self) -> bool:
        """Whether the query/key/value projection has a bias."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotary embeddings rotate (the first ones; 0 without rope)."""
        if self.position_embedding_type != "rope":
            return 0
        return int(self.head_dim * self.rotary_percent)

    @property
    def tied_embeddings(self) -> bool:
        """Whether the output layer uses the word embedding's weight."""
        return not self.untie_embeddings_and_output_weights


def check_fusion_flags(m: ModelConfig, *, as_flags: bool = True) -> None:
    """Refuse switching off the fusion of an architecture feature the model does not have.

    Megatron-LM ignores such a flag (its ``bias_activation_fusion`` reads the flag of the activation in use;
    ``apply_rope_fusion`` is cleared without rotary embeddings). Here ``--no-bias-swiglu-fusion`` without
    ``--swiglu`` and ``--no-rope-fusion`` without rotary embeddings are refused: they say the model was
    meant to have that feature (no Megatron-LM launch script passes them so). Two other flags that change
    nothing for some models are passed by Megatron-LM's own scripts as boilerplate (``--no-bias-gelu-fusion``
    with ``--swiglu``, ``--no-masked-softmax-fusion`` with FlashAttention): those run, and the start-up line
    says they change nothing (`fusion_notes`).
    """
    def n(field_name: str, flag: str) -> str:
        return flag if as_flags else field_name

    if not m.bias_swiglu_fusion and not m.swiglu:
        raise ConfigError(f"{n('bias_swiglu_fusion', '--no-bias-swiglu-fusion')} needs a SwiGLU MLP "
                          f"({n('swiglu', '--swiglu')}): this model's MLP is GELU (its switch is "
                          "--no-bias-gelu-fusion)")
    if not m.apply_rope_fusion and m.position_embedding_type != "rope":
        raise ConfigError(f"{n('apply_rope_fusion', '--no-rope-fusion')} needs rotary embeddings "
                          f"({n('position_embedding_type', '--position-embedding-type')} rope): this model has "
                          f"{m.position_embedding_type} positions")
    if m.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"{n('attention_backend', '--attention-backend')} must be one of "
                          f"{', '.join(ATTENTION_BACKENDS)}, got {m.attention_backend!r}")


def fusion_notes(m: ModelConfig) -> list[str]:
    """'--flag (why it changes nothing here)' for the fusion switches this model has no chain for."""
    notes = []
    if not m.bias_gelu_fusion and m.swiglu:
        notes.append("--no-bias-gelu-fusion (the MLP is SwiGLU: its switch is --no-bias-swiglu-fusion)")
    if not m.masked_softmax_fusion and m.attention_backend not in ("unfused", "local"):
        notes.append(f"--no-masked-softmax-fusion (only the unfused and local attention backends have a separate "
                     f"masked softmax; this run's is {m.attention_backend})")
    return notes


def check_model_shape(m: ModelConfig, tp: int, sequence_parallel: bool = False, *, as_flags: bool = True,
                      tp_name: str | None = None) -> None:
    """Shape rules of the Transformer under a tensor-parallel size, shared by the CLI's ``validate``
    (messages name flags), per-stage layouts (``tp_name="stage 1's tp"``) and the model
    constructors (``as_flags=False``: messages name config fields)."""
    def n(field_name: str) -> str:
        return "--" + field_name.replace("_", "-") if as_flags else field_name

    tp_name = tp_name or ("--tensor-model-parallel-size" if as_flags else "tensor-parallel size")
    for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length"):
        if getattr(m, f) < 1:
            raise ConfigError(f"{n(f)} must be at least 1, got {getattr(m, f)}")
    for f, allowed in (("normalization", NORMALIZATIONS), ("position_embedding_type", POSITION_EMBEDDING_TYPES)):
        if getattr(m, f) not in allowed:
            raise ConfigError(f"{n(f)} must be one of {', '.join(allowed)}, got {getattr(m, f)!r}")
    if m.kv_channels is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(f"{n('hidden_size')} {m.hidden_size} is not divisible by {n('num_attention_heads')} "
                              f"{m.num_attention_heads} (or give {n('kv_channels')})")
    elif m.kv_channels < 1:
        raise ConfigError(f"{n('kv_channels')} must be at least 1, got {m.kv_channels}")
    for f in ("hidden_size", "num_attention_heads", "ffn_hidden_size"):
        if getattr(m, f) % tp:
            raise ConfigError(f"{n(f)} {getattr(m, f)} is not divisible by {tp_name} {tp}")
    if m.group_query_attention:
        g, h = m.num_query_groups, m.num_attention_heads
        if g < 1:
            raise ConfigError(f"{n('num_query_groups')} must be at least 1, got {g}")
        if h % g:
            raise ConfigError(f"{n('num_attention_heads')} {h} is not divisible by {n('num_query_groups')} {g}: "
                              "every key/value head serves the same number of query heads")
        if g % tp:
            raise ConfigError(f"{n('num_query_groups')} {g} is not divisible by {tp_name} {tp}: each tensor-parallel "
                              f"rank holds whole key/value heads ({h} query heads in {g} groups)")
    if m.swiglu and m.openai_gelu:
        raise ConfigError(f"{n('swiglu')} and {n('openai_gelu')} conflict: the MLP has one activation")
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"{n('max_position_embeddings')} {m.max_position_embeddings} is smaller than "
                          f"{n('seq_length')} {m.seq_length}")
    if m.position_embedding_type == "rope":
        if m.rotary_base <= 0:
            raise ConfigError(f"{n('rotary_base')} must be positive, got {m.rotary_base}")
        if not 0.0 < m.rotary_percent <= 1.0:
            raise ConfigError(f"{n('rotary_percent')} must be in (0, 1], got {m.rotary_percent}")
        if m.rotary_dim < 2 or m.rotary_dim % 2:
            raise ConfigError(f"{n('rotary_percent')} {m.rotary_percent} of {m.head_dim} channels per head rotates "
                              f"{m.rotary_dim}: it must be an even number of at least 2")
    if m.norm_epsilon < 0:
        raise ConfigError(f"{n('norm_epsilon')} must be >= 0, got {m.norm_epsilon}")
    if m.qk_layernorm and tp > 1 and not sequence_parallel and as_flags:   # training's rule (a model built for
        # inference may run without: the attention refuses a training forward instead, ParallelAttention.norm_qk)
        raise ConfigError(f"{n('qk_layernorm')} with {tp_name} {tp} needs --sequence-parallel: each tp rank normalizes "
                          "its own heads, and the query/key norm weights' gradients are summed over tp with the "
                          "sequence-parallel ones")
    check_fusion_flags(m, as_flags=as_flags)
    if sequence_parallel and tp > 1 and m.seq_length % tp:
        sp_name = "--sequence-parallel" if as_flags else "sequence parallelism"
        raise ConfigError(f"{sp_name} needs {n('seq_length')} {m.seq_length} divisible by {tp_name} {tp}")
