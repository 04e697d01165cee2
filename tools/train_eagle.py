"""Train EAGLE-3 draft heads on the CPU: ``tiny`` (a small target and its head) or ``chat``.

``tiny``: a small Llama target and its head, so speculative decoding can be tested and
demonstrated end to end without downloading anything (written to ``tools/eagle_pair``):

1. Target: a 4-layer ``LlamaForCausalLM`` trained on ``tools/data/tinyshakespeare.txt``
   (the last 5% of the tokens are held out), tokenized with tandem's byte-level default
   tokenizer. Saved as a Hugging Face folder that ``tandem.scheduler.Engine`` loads.
2. Draft: distilled from the target's greedy predictions on the training text and on
   text the target generated itself.
3. Check: on held-out text, a greedy chain speculative decode reports the mean accept
   length (generated tokens per verify step).

``chat``: a head for a chat model tandem serves (``--model-path``; by default the real
default model, SmolLM2-135M-Instruct as its Q4_1 GGUF, whose head ships in
``tandem-spec-eagle``), by self-distillation:

1. Prompts: chat requests made here from task templates and topics (``CHAT_TASKS``,
   ``TRAIN_TOPICS``; no outside data, so no licence question). Held-out prompts use
   topics training never sees (``HELDOUT_TOPICS``) and go to ``--heldout-file`` with
   the target's answers (ShareGPT's layout, what ``tandem bench --workload sharegpt``
   reads; for the default model ``tools/data/smollm2_heldout_chat.json``).
2. Answers: tandem's engine answers every prompt greedily (the weights it serves).
3. Features: transformers reads the same checkpoint (or GGUF file) and returns, per
   token of prompt and answer, the outputs of the three capture layers and its greedy
   next token.
4. Draft: one decoder layer over ``[embedding, fc(features)]``, trained with the
   training-time-test unroll, the way it runs at inference.
5. Check: tandem's engine serves the held-out prompts with and without the head; the
   outputs must be equal, and the accept length is printed.

Both heads: one decoder layer (EAGLE-3's layout), a draft vocabulary of the most frequent
label tokens with its ``d2t`` map, weights in bfloat16 (safetensors); every run with the
same seed, step counts and thread count writes the same weights (``--max-minutes`` is a
safety net for a busy machine; a run it cuts short says so).

Run from the repository root with the dev virtual environment::

    python tools/train_eagle.py tiny      # ~11.5 minutes on an idle 2-core machine
    python tools/train_eagle.py chat      # the default model's head, ~35 minutes
    python tools/train_eagle.py chat --model-path ORG/NAME --output heads/name

``--help`` after either lists its options.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.scheduler.models.tiny import (
    _generation_config,
    build_default_tokenizer,
    default_model_config,
    tokenizer_config,
    write_json,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = REPO_ROOT / "tools" / "data" / "tinyshakespeare.txt"
TINY_OUTPUT = REPO_ROOT / "tools" / "eagle_pair"
# Where the default model's head and its held-out prompts go.
BUILT_IN_HEAD = (
    REPO_ROOT / "packages" / "spec-eagle" / "src" / "tandem" / "spec_eagle" / "heads" / "smollm2"
)
DEFAULT_HELDOUT = REPO_ROOT / "tools" / "data" / "smollm2_heldout_chat.json"


@dataclass(frozen=True)
class HeadShape:
    """What a head's modules need (the target dictates all but ``intermediate`` and
    ``draft_vocab``)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    aux_layers: tuple[int, int, int]


# The tiny target's shape (Llama field names).
HIDDEN = 192
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 48
INTERMEDIATE = 512
MAX_POSITIONS = 1024
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
# Residual streams the tiny head reads: outputs of decoder layers 0, 1 and 2 (never the last).
TINY_AUX_LAYERS = (0, 1, 2)
TINY_DRAFT_VOCAB = 256
HOLDOUT_FRACTION = 0.05

_START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    targets = parser.add_subparsers(dest="target", required=True)
    tiny = targets.add_parser("tiny", help="the small Shakespeare target and its head")
    chat = targets.add_parser("chat", help="a head for a chat model (default: the default one)")
    for sub, output, steps, batch, minutes in (
        (tiny, TINY_OUTPUT, 500, 16, 14.0),
        (chat, None, 1200, 8, 60.0),
    ):
        lr = 4e-3 if sub is tiny else 2e-3
        sub.add_argument(
            "--output",
            type=Path,
            default=output,
            help="output folder (chat: the built-in head's for the default model; another "
            "model needs one)",
        )
        sub.add_argument("--seed", type=int, default=1234)
        sub.add_argument("--threads", type=int, default=2, help="torch CPU threads")
        sub.add_argument("--batch-size", type=int, default=batch)
        sub.add_argument("--draft-steps", type=int, default=steps, help="draft optimizer steps")
        sub.add_argument("--draft-lr", type=float, default=lr)
        sub.add_argument(
            "--ttt-steps",
            type=int,
            default=3,
            help="draft steps unrolled in training (training-time test): the chain length "
            "the head is trained for",
        )
        sub.add_argument(
            "--max-minutes",
            type=float,
            default=minutes,
            help="safety net for a busy machine: training stops early near this budget "
            "(the run then says so and is not reproducible); 0 disables it",
        )
    tiny.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="training text")
    tiny.add_argument("--seq-len", type=int, default=256, help="training window, tokens")
    tiny.add_argument("--target-steps", type=int, default=400, help="target optimizer steps")
    tiny.add_argument("--target-lr", type=float, default=2e-3)
    tiny.add_argument(
        "--self-distill",
        type=int,
        default=256,
        help="extra draft training windows written by the target itself (greedy "
        "continuations of training-text prompts), the text the draft sees at inference",
    )
    tiny.add_argument("--eval-prompts", type=int, default=24, help="spec-decode prompts")
    tiny.add_argument("--eval-new-tokens", type=int, default=96)
    chat.add_argument("--train-prompts", type=int, default=2400, help="training chat prompts")
    chat.add_argument("--heldout-prompts", type=int, default=64, help="held-out chat prompts")
    chat.add_argument("--answer-tokens", type=int, default=128, help="most tokens an answer has")
    chat.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size")
    chat.add_argument(
        "--heldout-file",
        type=Path,
        help="where the held-out prompts go (default: tools/data/smollm2_heldout_chat.json "
        "for the default model, else heldout_chat.json in --output)",
    )
    chat.add_argument(
        "--model-path",
        help="the target, as `tandem serve --model-path` takes it (default: the default model)",
    )
    chat.add_argument("--no-check", action="store_true", help="skip the served check")
    args = parser.parse_args()
    if args.target == "chat":
        if args.output is None:
            if args.model_path is not None:
                parser.error("argument --output: required with --model-path")
            args.output = BUILT_IN_HEAD
        if args.heldout_file is None:
            default = args.model_path is None
            args.heldout_file = DEFAULT_HELDOUT if default else args.output / "heldout_chat.json"
    return args


# -- data ---------------------------------------------------------------------------------------


def load_tokens(text_path: Path) -> tuple[Any, torch.Tensor, torch.Tensor]:
    tokenizer = build_default_tokenizer()
    text = text_path.read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    split = int(len(ids) * (1.0 - HOLDOUT_FRACTION))
    return tokenizer, ids[:split], ids[split:]


def random_windows(
    ids: torch.Tensor, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - length, (batch,), generator=gen)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


def tiled_windows(ids: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    count = (len(ids) - offset) // length
    return ids[offset : offset + count * length].view(count, length)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def out_of_time(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


# -- target -------------------------------------------------------------------------------------


def target_config_dict(tokenizer: Any) -> dict[str, Any]:
    config = default_model_config(tokenizer)
    config.update(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_EPS,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    return config


def build_target(config: dict[str, Any]) -> LlamaForCausalLM:
    fields = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    hf_config = LlamaConfig(**fields)
    hf_config._attn_implementation = "sdpa"
    return LlamaForCausalLM(hf_config)


def lm_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        total += lm_loss(model, chunk).item() * len(chunk)
        count += len(chunk)
    model.train()
    return total / count


def train_target(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    train_ids: torch.Tensor,
    eval_ids: torch.Tensor,
    deadline: float | None,
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.target_lr,
        betas=(0.9, 0.95),
    )
    eval_windows = tiled_windows(eval_ids, args.seq_len)
    model.train()
    steps = args.target_steps
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.target_lr, warmup=min(100, steps // 10 + 1))
        batch = random_windows(train_ids, args.batch_size, args.seq_len, gen)
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            heldout = mean_loss(model, eval_windows)
            log(f"target step {step:4d}/{steps} loss {loss.item():.3f} held-out {heldout:.3f}")
        if out_of_time(deadline):
            log(f"target: time budget reached after {step + 1} steps (not reproducible)")
            break
    model.eval()
    # The checkpoint is bfloat16: round now, so the draft learns the weights that ship.
    round_to_bfloat16(model)
    gen_eval = torch.Generator().manual_seed(args.seed + 2)
    train_sample = random_windows(train_ids, len(eval_windows), args.seq_len, gen_eval)
    return {
        "train_loss": mean_loss(model, train_sample),
        "heldout_loss": mean_loss(model, eval_windows),
    }


@torch.no_grad()
def target_pass(
    model: LlamaForCausalLM, ids: torch.Tensor, aux_layers: tuple[int, ...] = TINY_AUX_LAYERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy next-token ids ``[B, T]`` and the draft's input features ``[B, T, 3H]``."""
    out = model(input_ids=ids, output_hidden_states=True)
    # hidden_states[0] is the embedding output, hidden_states[i + 1] layer i's output.
    aux = torch.cat([out.hidden_states[i + 1] for i in aux_layers], dim=-1)
    return out.logits.argmax(-1), aux.float()


@torch.no_grad()
def self_distill_windows(
    model: LlamaForCausalLM, train_ids: torch.Tensor, args: argparse.Namespace, config: dict
) -> torch.Tensor:
    """``args.self_distill`` windows: 32 training tokens, then the target's greedy text."""
    if args.self_distill <= 0:
        return torch.empty(0, args.seq_len, dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed + 4)
    prompts = random_windows(train_ids, args.self_distill, 32, gen)
    new = args.seq_len - prompts.shape[1]
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=config["eos_token_id"],
    )
    return out[:, : args.seq_len]


def save_target(model: LlamaForCausalLM, config: dict[str, Any], tokenizer: Any, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config)
    (folder / "tokenizer.json").write_bytes((tokenizer.to_str(pretty=True) + "\n").encode())
    write_json(folder / "tokenizer_config.json", tokenizer_config())
    write_json(folder / "generation_config.json", _generation_config(tokenizer))


# -- EAGLE-3 draft head -------------------------------------------------------------------------


def rope_tables(s: HeadShape, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (
        s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim)
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    both = torch.cat([angles, angles], dim=-1)
    return both.cos(), both.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def shift_positions(x: torch.Tensor, by: int) -> torch.Tensor:
    """``out[..., q, :] = x[..., q - by, :]`` along dim 2 (zeros where ``q < by``)."""
    if by == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :by]), x[:, :, :-by]], dim=2)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class DraftAttention(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.hidden_norm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = DraftAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp = DraftMLP(s)


class Eagle3Draft(nn.Module):
    """The draft head; its parameter names are the checkpoint's tensor names."""

    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.shape = s
        self.fc = nn.Linear(3 * s.hidden, s.hidden, bias=False)
        self.midlayer = DraftLayer(s)
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.lm_head = nn.Linear(s.hidden, s.draft_vocab, bias=False)

    def project(
        self, x: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, nh, T, hd]``, k and v ``[B, nkv, T, hd]`` of inputs ``x`` and ``emb``."""
        layer, sh = self.midlayer, self.shape
        z = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(x)], dim=-1)
        b, t, _ = z.shape
        q = layer.self_attn.q_proj(z).view(b, t, sh.heads, sh.head_dim).transpose(1, 2)
        k = layer.self_attn.k_proj(z).view(b, t, sh.kv_heads, sh.head_dim).transpose(1, 2)
        v = layer.self_attn.v_proj(z).view(b, t, sh.kv_heads, sh.head_dim).transpose(1, 2)
        cos, sin = rope_tables(sh, positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, res: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, o_proj, MLP block: the step's output hidden state ``[B, T, H]``."""
        layer = self.midlayer
        b, _, t, _ = attn.shape
        x = res + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def unrolled(self, aux: torch.Tensor, emb: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole windows: the logits ``[B, T, Vd]`` of every step.

        ``aux[:, p]`` are the target features at position p, ``emb[:, p]`` the embedding of
        token p + 1. Step 0 reads the features; step s at position q reads step s - 1's
        output at q - 1 and attends the step-0 keys at positions <= q - s plus, for each
        step j in 1..s, step j's key at position q - s + j (the chain that led to it).
        Rows with q < s have no such chain; they are computed but must not be trained on.
        """
        _, t, _ = aux.shape
        positions = torch.arange(t)
        x = self.fc(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        for s in range(steps):
            q, k, v = self.project(x, emb, positions)
            keys.append(k)
            values.append(v)
            hid = self.finish(x, self._unrolled_attention(q, keys, values, s))
            out.append(self.logits(hid))
            # The next step at position q continues the chain from this step's q - 1.
            x = torch.cat([torch.zeros_like(hid[:, :1]), hid[:, :-1]], dim=1)
        return out

    def _unrolled_attention(
        self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], step: int
    ) -> torch.Tensor:
        sh = self.shape
        t = q.shape[2]
        rep = sh.heads // sh.kv_heads
        scale = sh.head_dim**-0.5
        k0 = keys[0].repeat_interleave(rep, dim=1)
        v0 = values[0].repeat_interleave(rep, dim=1)
        rows = torch.arange(t)[:, None]
        cols = torch.arange(t)[None, :]
        visible = (cols <= rows - step) | ((rows < step) & (cols == 0))
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))]
        chain_values = []
        for j in range(1, step + 1):
            kj = shift_positions(keys[j].repeat_interleave(rep, dim=1), step - j)
            chain_values.append(shift_positions(values[j].repeat_interleave(rep, dim=1), step - j))
            scores.append((q * kj).sum(-1, keepdim=True) * scale)
        weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1)
        attn = weights[..., :t] @ v0
        for j, vj in enumerate(chain_values):
            attn = attn + weights[..., t + j : t + j + 1] * vj
        return attn

    @torch.no_grad()
    def propose(
        self,
        aux: torch.Tensor,
        emb_next: torch.Tensor,
        embed: nn.Embedding,
        d2t: torch.Tensor,
        steps: int,
    ) -> list[int]:
        """Inference on one sequence, as the engine runs it: draft-extend over the committed
        positions 0..L-1 (``aux [L, 3H]``, ``emb_next [L, H]`` = embeddings of tokens 1..L),
        then ``steps - 1`` recursive steps; returns ``steps`` target token ids
        (guesses for positions L + 1, L + 2, ...)."""
        length = aux.shape[0]
        x = self.fc(aux[None])
        q, k, v = self.project(x, emb_next[None], torch.arange(length))
        keys, values = [k], [v]
        hid = self.finish(x, self._attend_all(q, keys, values, True))[:, -1:]
        guesses = [self._guess(hid, d2t)]
        for s in range(1, steps):
            position = torch.tensor([length - 1 + s])
            q, k, v = self.project(hid, embed(torch.tensor([[guesses[-1]]])), position)
            keys.append(k)
            values.append(v)
            hid = self.finish(hid, self._attend_all(q, keys, values, False))
            guesses.append(self._guess(hid, d2t))
        return guesses

    def _guess(self, hid: torch.Tensor, d2t: torch.Tensor) -> int:
        draft_id = int(self.logits(hid)[0, -1].argmax())
        return draft_id + int(d2t[draft_id])

    def _attend_all(
        self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], causal: bool
    ) -> torch.Tensor:
        sh = self.shape
        rep = sh.heads // sh.kv_heads
        k = torch.cat(keys, dim=2).repeat_interleave(rep, dim=1)
        v = torch.cat(values, dim=2).repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) * sh.head_dim**-0.5
        if causal:
            t = q.shape[2]
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores.float(), dim=-1) @ v


def draft_vocabulary(
    label_ids: torch.Tensor, vocab: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent target ids (ties: lower id), sorted by id.

    Returns ``d2t`` (``target = draft + d2t[draft]``) and ``t2d`` (bool, target in vocab).
    """
    counts = torch.bincount(label_ids, minlength=vocab)
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    kept = torch.tensor(sorted(order[:size]), dtype=torch.long)
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def draft_labels(greedy: torch.Tensor, target_to_draft: torch.Tensor) -> torch.Tensor:
    """Label of draft position q: the target's greedy token after q + 1, as a draft id."""
    labels = torch.full_like(greedy, -100)
    labels[:, :-1] = target_to_draft[greedy[:, 1:]]
    return labels


def next_embeddings(embed: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """``out[:, q]`` = embedding of token q + 1 (zeros at the last position)."""
    with torch.no_grad():
        emb = embed(tokens[:, 1:])
    return torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=1)


def step_weight(step: int) -> float:
    """The unrolled loss's weight of draft step ``step``: 1, 0.8, 0.64, ... (rounded, so
    that 0.8 ** 2 is the literal 0.64 the committed tiny pair was trained with)."""
    return round(0.8**step, 6)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Tokens ``[B, T]``, target features ``[B, T, 3H]`` and draft labels ``[B, T]``."""


def train_draft(
    args: argparse.Namespace,
    draft: Eagle3Draft,
    embed: nn.Embedding,
    sample: Callable[[int], Batch],
    deadline: float | None,
) -> None:
    """``args.draft_steps`` AdamW steps on the unrolled loss; ``sample(step)`` gives the
    step's batch, step ``s`` of the unroll weighted ``step_weight(s)``."""
    opt = torch.optim.AdamW(
        draft.parameters(), lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    steps, unroll = args.draft_steps, args.ttt_steps
    draft.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.draft_lr, warmup=min(50, steps // 10 + 1))
        tokens, aux, labels = sample(step)
        rows = torch.arange(tokens.shape[1])[None, :]
        emb = next_embeddings(embed, tokens)
        logits = draft.unrolled(aux.float(), emb, unroll)
        loss = torch.zeros(())
        accs = []
        for s, step_logits in enumerate(logits):
            lab = labels.masked_fill(rows < s, -100)
            loss = loss + step_weight(s) * F.cross_entropy(
                step_logits.flatten(0, 1), lab.flatten(), ignore_index=-100
            )
            valid = lab != -100
            accs.append((step_logits.argmax(-1)[valid] == lab[valid]).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            acc = " ".join(f"{a:.3f}" for a in accs)
            log(f"draft step {step:4d}/{steps} loss {loss.item():.3f} acc/step {acc}")
        if out_of_time(deadline):
            log(f"draft: time budget reached after {step + 1} steps (not reproducible)")
            break
    draft.eval()
    round_to_bfloat16(draft)


@torch.no_grad()
def round_to_bfloat16(module: nn.Module) -> None:
    """Round every parameter to bfloat16 (kept in float32): the checkpoints ship in
    bfloat16, so what is measured and learned after training uses what ships."""
    for p in module.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))


@torch.no_grad()
def check_unrolled_matches_inference(
    draft: Eagle3Draft, embed: nn.Embedding, tokens: torch.Tensor, aux: torch.Tensor, steps: int
) -> None:
    """The training unroll and the step-by-step inference path compute the same thing."""
    emb = next_embeddings(embed, tokens[None])
    aux = aux.float()
    logits = draft.unrolled(aux[None], emb, steps)
    worst = 0.0
    for root in sorted({3, len(tokens) // 2, len(tokens) - steps - 2}):
        # Step s at position root + s reads the real token root + s + 1 in training; feed
        # the same tokens as "guesses" to the inference path.
        length = root + 1
        x = draft.fc(aux[None, :length])
        q, k, v = draft.project(x, emb[:, :length], torch.arange(length))
        keys, values = [k], [v]
        hid = draft.finish(x, draft._attend_all(q, keys, values, True))[:, -1:]
        worst = max(worst, float((draft.logits(hid)[0, 0] - logits[0][0, root]).abs().max()))
        for s in range(1, steps):
            pos = root + s
            q, k, v = draft.project(
                hid, embed(tokens[None, pos + 1 : pos + 2]), torch.tensor([pos])
            )
            keys.append(k)
            values.append(v)
            hid = draft.finish(hid, draft._attend_all(q, keys, values, False))
            worst = max(worst, float((draft.logits(hid)[0, 0] - logits[s][0, pos]).abs().max()))
    if worst > 1e-3:
        raise AssertionError(f"training unroll and inference disagree (max |diff| {worst:.2e})")
    log(f"unrolled training forward matches step-by-step inference (max |diff| {worst:.1e})")


def draft_config_dict(s: HeadShape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "vocab_size": s.vocab,
        "draft_vocab_size": s.draft_vocab,
        "rms_norm_eps": s.rms_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_positions,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s.aux_layers)},
    }


def save_draft(
    draft: Eagle3Draft,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    folder: Path,
    extra: dict[str, Any] | None = None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in draft.state_dict().items()
    }
    state["d2t"] = d2t.to(torch.int64).contiguous()
    state["t2d"] = t2d.to(torch.bool).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", draft_config_dict(draft.shape) | (extra or {}))


def new_draft(
    args: argparse.Namespace,
    s: HeadShape,
    head_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    d2t: torch.Tensor,
) -> Eagle3Draft:
    """A draft warm-started from the target's own output head (its draft-vocabulary
    rows) and final norm."""
    torch.manual_seed(args.seed + 10)
    draft = Eagle3Draft(s)
    with torch.no_grad():
        draft.lm_head.weight.copy_(head_weight[torch.arange(s.draft_vocab) + d2t])
        draft.norm.weight.copy_(norm_weight)
    log(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters")
    return draft


# -- the tiny pair ------------------------------------------------------------------------------


@torch.no_grad()
def simulate_speculative_decoding(
    target: LlamaForCausalLM,
    draft: Eagle3Draft,
    d2t: torch.Tensor,
    eval_ids: torch.Tensor,
    prompts: int,
    prompt_len: int,
    new_tokens: int,
    steps: int,
) -> float:
    """Greedy chain speculative decoding on held-out prompts; the mean accept length.

    Each round: the draft extends over the committed tokens (target features at every
    committed position, the pending bonus token as the last input), proposes
    ``steps`` tokens, the target scores them in one pass, the longest prefix that
    matches the target's own greedy choice is accepted plus one bonus token.
    """
    embed = target.get_input_embeddings()
    span = len(eval_ids) - prompt_len - 1
    starts = [int(i * span / max(1, prompts - 1)) for i in range(prompts)]
    generated = 0
    rounds = 0
    for n, start in enumerate(starts):
        seq = eval_ids[start : start + prompt_len].tolist()
        greedy, aux = target_pass(target, torch.tensor([seq]))
        bonus = int(greedy[0, -1])
        features = aux[0]
        produced: list[int] = []
        while len(produced) < new_tokens:
            emb_next = embed(torch.tensor([*seq[1:], bonus]))
            guesses = draft.propose(features, emb_next, embed, d2t, steps)
            candidate = [*seq, bonus, *guesses]
            greedy, aux = target_pass(target, torch.tensor([candidate]))
            length = len(seq)
            # greedy[0, p] is the target's choice for position p + 1.
            accepted = 0
            while accepted < len(guesses) and guesses[accepted] == int(
                greedy[0, length + accepted]
            ):
                accepted += 1
            seq = [*seq, bonus, *guesses[:accepted]]
            produced += [bonus, *guesses[:accepted]]
            bonus = int(greedy[0, length + accepted])
            features = aux[0, : len(seq)]
            generated += accepted + 1
            rounds += 1
        if n == 0:
            check_matches_plain_greedy(target, eval_ids[start : start + prompt_len], produced)
    return generated / rounds


@torch.no_grad()
def check_matches_plain_greedy(
    target: LlamaForCausalLM, prompt: torch.Tensor, produced: list[int]
) -> None:
    seq = prompt.tolist()
    for _ in range(len(produced)):
        seq.append(int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    if seq[len(prompt) :] != produced:
        raise AssertionError("speculative decoding diverged from plain greedy decoding")


TINY_SHAPE = HeadShape(
    hidden=HIDDEN,
    heads=HEADS,
    kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    intermediate=512,
    vocab=0,  # set from the tokenizer
    draft_vocab=TINY_DRAFT_VOCAB,
    rope_theta=ROPE_THETA,
    rms_eps=RMS_EPS,
    max_positions=MAX_POSITIONS,
    aux_layers=TINY_AUX_LAYERS,
)


def train_tiny_pair(args: argparse.Namespace) -> dict[str, Any]:
    budget = args.max_minutes * 60.0 if args.max_minutes > 0 else None
    tokenizer, train_ids, eval_ids = load_tokens(args.text)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    shape = TINY_SHAPE.__class__(**{**TINY_SHAPE.__dict__, "vocab": vocab})
    log(f"text: {len(train_ids)} training tokens, {len(eval_ids)} held out; vocab {vocab}")

    # 1. Target.
    config = target_config_dict(tokenizer)
    torch.manual_seed(args.seed)
    target = build_target(config)
    params = sum(p.numel() for p in target.parameters())
    log(f"target: {params / 1e6:.2f}M parameters, {args.target_steps} steps")
    deadline = None if budget is None else _START + 0.55 * budget
    losses = train_target(args, target, train_ids, eval_ids, deadline)
    log(
        f"target (bf16 weights): train loss {losses['train_loss']:.3f}, "
        f"held-out loss {losses['heldout_loss']:.3f}"
    )
    for p in target.parameters():
        p.requires_grad_(False)
    save_target(target, config, tokenizer, args.output / "target")
    log(f"saved {args.output / 'target'}")

    # 2. Draft data: target features and greedy labels over the training text (two tilings)
    # and over the target's own greedy continuations.
    half = args.seq_len // 2
    tokens = torch.cat(
        [
            tiled_windows(train_ids, args.seq_len),
            tiled_windows(train_ids, args.seq_len, half),
            self_distill_windows(target, train_ids, args, config),
        ]
    )
    greedy_parts, aux_parts = [], []
    for i in range(0, len(tokens), 32):
        greedy, aux = target_pass(target, tokens[i : i + 32])
        greedy_parts.append(greedy)
        aux_parts.append(aux)
    greedy, aux = torch.cat(greedy_parts), torch.cat(aux_parts)
    d2t, t2d = draft_vocabulary(train_ids, vocab, shape.draft_vocab)
    target_to_draft = torch.full((vocab,), -100, dtype=torch.long)
    target_to_draft[t2d] = torch.arange(shape.draft_vocab)
    labels = draft_labels(greedy, target_to_draft)
    coverage = (labels[:, :-1] != -100).float().mean().item()
    log(f"draft data: {len(tokens)} windows; draft vocab covers {coverage:.4f} of the labels")

    # 3. Draft.
    draft = new_draft(args, shape, target.lm_head.weight, target.model.norm.weight, d2t)
    embed = target.get_input_embeddings()
    gen = torch.Generator().manual_seed(args.seed + 3)

    def sample(step: int) -> Batch:
        pick = torch.randint(0, len(tokens), (args.batch_size,), generator=gen)
        return tokens[pick], aux[pick], labels[pick]

    deadline = None if budget is None else _START + budget - 60.0
    train_draft(args, draft, embed, sample, deadline)
    for p in draft.parameters():
        p.requires_grad_(False)
    check_unrolled_matches_inference(draft, embed, tokens[0], aux[0], args.ttt_steps)
    save_draft(draft, d2t, t2d, args.output / "eagle3")
    log(f"saved {args.output / 'eagle3'}")

    # 4. Check.
    accept = simulate_speculative_decoding(
        target, draft, d2t, eval_ids, args.eval_prompts, 64, args.eval_new_tokens, args.ttt_steps
    )
    log(f"simulated greedy speculative decoding ({args.ttt_steps} draft tokens, held-out):")
    log(f"mean accept length {accept:.3f} tokens per verify step (max {args.ttt_steps + 1})")
    return {
        "target_train_loss": round(losses["train_loss"], 4),
        "target_heldout_loss": round(losses["heldout_loss"], 4),
        "mean_accept_length": round(accept, 4),
    }


# -- the default model's head ---------------------------------------------------------------------

# Chat requests are made from a task and a topic. Held-out topics never appear in training.
CHAT_TASKS = (
    "What is {topic}?",
    "Explain {topic} in simple terms.",
    "Give me three facts about {topic}.",
    "Write a short paragraph about {topic}.",
    "Why is {topic} important?",
    "How would you describe {topic} to a child?",
    "List the main ideas behind {topic}.",
    "Write a haiku about {topic}.",
    "What are common misconceptions about {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a short story that involves {topic}.",
    "How does {topic} affect everyday life?",
    "Give me a step-by-step introduction to {topic}.",
    "What questions should a beginner ask about {topic}?",
    "Compare {topic} with something similar.",
    "Write a tweet about {topic}.",
    "What is the future of {topic}?",
    "Explain {topic} as if you were a teacher.",
    "Write a short poem about {topic}.",
    "What should I read to learn about {topic}?",
    "Describe {topic} in one sentence.",
    "What are some fun facts about {topic}?",
    "How can I get started with {topic}?",
    "Write an email to a friend about {topic}.",
    "What problems does {topic} solve?",
    "Give an example of {topic}.",
    "Tell me a joke about {topic}.",
    "What do experts say about {topic}?",
    "Write a product description related to {topic}.",
    "Explain the basics of {topic} in three bullet points.",
    "What is the difference between {topic} and its alternatives?",
)
TRAIN_TOPICS = (
    "photosynthesis", "the water cycle", "gravity", "the solar system", "volcanoes",
    "earthquakes", "climate change", "recycling", "electricity", "magnets",
    "the human heart", "sleep", "healthy eating", "exercise", "meditation",
    "the internet", "computers", "programming", "Python", "databases",
    "artificial intelligence", "robots", "smartphones", "social media", "cybersecurity",
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution",
    "democracy", "money", "banks", "inflation", "supply and demand", "taxes",
    "coffee", "tea", "bread baking", "chocolate", "pizza", "gardening", "bees", "dogs",
    "cats", "birds", "the ocean", "rainforests", "deserts", "mountains", "rivers",
    "music", "painting", "poetry", "chess", "football", "the Olympic Games", "friendship",
    "time management", "public speaking", "learning a language",
    "the stock market", "the immune system", "DNA", "evolution", "dinosaurs", "fossils",
    "satellites", "airplanes", "cars", "electric vehicles", "ships",
    "bridges", "skyscrapers", "architecture", "the Renaissance", "Greek mythology",
    "the Vikings", "the Silk Road", "the French Revolution", "World War II", "the Cold War",
    "human rights", "elections", "the United Nations", "globalization", "trade",
    "unemployment", "startups", "marketing", "advertising", "customer service",
    "leadership", "teamwork", "negotiation", "job interviews", "writing a resume",
    "saving money", "budgeting", "investing", "credit cards", "mortgages", "insurance",
    "cooking pasta", "vegetarian food", "spices", "baking cakes", "wine", "cheese",
    "fruit", "vegetables", "vitamins", "running", "yoga", "swimming", "basketball",
    "tennis", "cycling", "hiking", "camping", "fishing", "photography", "film",
    "theater", "novels", "fairy tales", "comics", "video games",
    "the piano", "the guitar", "classical music", "rock music", "dance", "sculpture",
    "fashion", "sewing", "knitting", "pottery", "woodworking", "home repair",
    "plumbing", "gardening tools", "houseplants", "composting", "pollution", "oceans",
    "coral reefs", "glaciers", "weather forecasts", "hurricanes", "tornadoes", "lightning",
    "the sun", "stars", "galaxies", "Mars", "Jupiter", "comets", "telescopes",
    "microscopes", "chemistry", "atoms", "energy", "nuclear power", "batteries",
    "semiconductors", "cloud computing", "open source",
    "email", "passwords", "machine learning", "data science", "statistics",
    "probability", "algebra", "geometry", "prime numbers", "calculus", "logic",
    "philosophy", "ethics", "psychology", "memory", "emotions", "habits", "motivation",
    "stress", "happiness", "parenting", "education", "homework", "universities",
    "online learning", "museums", "tourism", "maps", "islands", "volunteering",
)  # fmt: skip
HELDOUT_TOPICS = (
    "black holes", "vaccines", "the moon", "bicycles", "renewable energy", "libraries",
    "honey", "whales", "the Great Wall of China", "jazz", "origami", "trains",
    "rain", "clouds", "kindness", "board games",
)  # fmt: skip


def chat_prompts(topics: tuple[str, ...], count: int, seed: int) -> list[str]:
    """``count`` distinct task x topic requests, picked by ``seed``."""
    every = [task.format(topic=topic) for topic in topics for task in CHAT_TASKS]
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed))
    return [every[i] for i in order[:count].tolist()]


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as the server renders a one-turn chat request."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def greedy_answers(prompts: list[list[int]], max_tokens: int, **engine: Any) -> tuple:
    """tandem's greedy answers (output ids) and the engine's server info."""
    from tandem.scheduler import Engine

    eng = Engine(device="cpu", **engine)
    try:
        params = {"max_new_tokens": max_tokens, "temperature": 0.0}
        out = eng.generate(input_ids=prompts, sampling_params=params)
        info = eng.get_server_info()
    finally:
        eng.shutdown()
    return [list(r["output_ids"]) for r in out], info


@torch.no_grad()
def capture_features(
    model: LlamaForCausalLM, seqs: list[list[int]], aux_layers: tuple[int, ...], batch: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the target's greedy next tokens ``[T]`` and features ``[T, 3H]``
    (bfloat16, to halve the memory they hold). Batches of similar lengths, right-padded:
    causal attention keeps padding out of every real position."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    greedy: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    feats: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for n, start in enumerate(range(0, len(order), batch)):
        group = order[start : start + batch]
        width = max(len(seqs[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        g, a = target_pass(model, ids, aux_layers)
        for row, i in enumerate(group):
            greedy[i] = g[row, : len(seqs[i])].clone()
            feats[i] = a[row, : len(seqs[i])].to(torch.bfloat16)
        if n % 20 == 0:
            log(f"features: {start + len(group)}/{len(seqs)} sequences")
    return greedy, feats


def length_batches(lengths: list[int], size: int) -> list[list[int]]:
    """Sequences grouped by length, ``size`` a group (the last may be smaller)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + size] for i in range(0, len(order), size)]


def pad_batch(
    group: list[int], seqs: list[list[int]], feats: list[torch.Tensor], labels: list[torch.Tensor]
) -> Batch:
    width = max(len(seqs[i]) for i in group)
    tokens = torch.zeros(len(group), width, dtype=torch.long)
    aux = torch.zeros(len(group), width, feats[group[0]].shape[-1], dtype=torch.bfloat16)
    lab = torch.full((len(group), width), -100, dtype=torch.long)
    for row, i in enumerate(group):
        n = len(seqs[i])
        tokens[row, :n] = torch.tensor(seqs[i])
        aux[row, :n] = feats[i]
        lab[row, :n] = labels[i]
    return tokens, aux, lab


def reference_model(model_path: str | None, folder: Path) -> LlamaForCausalLM:
    """The target in transformers, float32: the default model's GGUF file, another GGUF
    file, or the checkpoint folder tandem resolved."""
    from transformers import AutoModelForCausalLM

    from tandem.scheduler.models.fetch import default_model_file

    gguf: Path | None = None
    if model_path is None:
        gguf = default_model_file()
    elif str(model_path).endswith(".gguf") and Path(model_path).is_file():
        gguf = Path(model_path)
    if gguf is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


def train_chat_head(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.scheduler.models import ModelConfig
    from tandem.scheduler.models.source import resolve_model
    from tandem.scheduler.text.tokenizer import Tokenizer
    from tandem.spec_eagle.draft_config import default_aux_layers

    budget = args.max_minutes * 60.0 if args.max_minutes > 0 else None
    folder = resolve_model(args.model_path)
    tokenizer = Tokenizer.from_pretrained(folder)
    cfg = ModelConfig.from_pretrained(folder)
    shape = HeadShape(
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate_size,
        vocab=cfg.vocab_size,
        draft_vocab=args.draft_vocab,
        rope_theta=cfg.rope_theta,
        rms_eps=cfg.rms_norm_eps,
        max_positions=cfg.max_position_embeddings,
        aux_layers=default_aux_layers(cfg.num_hidden_layers),
    )

    # 1-2. Prompts and the target's answers.
    train_text = chat_prompts(TRAIN_TOPICS, args.train_prompts, args.seed)
    heldout_text = chat_prompts(HELDOUT_TOPICS, args.heldout_prompts, args.seed + 1)
    prompts = [chat_ids(tokenizer, p) for p in train_text + heldout_text]
    log(f"answering {len(prompts)} prompts ({len(heldout_text)} held out) with tandem")
    answers, _ = greedy_answers(prompts, args.answer_tokens, model_path=args.model_path)
    n_train = len(train_text)
    heldout = [
        {
            "id": f"heldout-{i}",
            "conversations": [
                {"from": "human", "value": text},
                {"from": "gpt", "value": tokenizer.decode(answers[n_train + i])},
            ],
        }
        for i, text in enumerate(heldout_text)
    ]
    args.heldout_file.parent.mkdir(parents=True, exist_ok=True)
    args.heldout_file.write_text(json.dumps(heldout, indent=1, ensure_ascii=False) + "\n")
    seqs = [p + a for p, a in zip(prompts[:n_train], answers[:n_train], strict=True)]
    log(f"answers: {sum(len(a) for a in answers[:n_train])} training tokens")

    # 3. Features.
    model = reference_model(args.model_path, folder)
    greedy, feats = capture_features(model, seqs, shape.aux_layers, args.batch_size)
    d2t, t2d = draft_vocabulary(torch.cat(greedy), shape.vocab, shape.draft_vocab)
    target_to_draft = torch.full((shape.vocab,), -100, dtype=torch.long)
    target_to_draft[t2d] = torch.arange(shape.draft_vocab)
    labels = [draft_labels(g[None], target_to_draft)[0] for g in greedy]
    covered = sum(int((lab[:-1] != -100).sum()) for lab in labels)
    log(f"draft vocab covers {covered / sum(len(s) - 1 for s in seqs):.4f} of the labels")

    # 4. Draft.
    head_weight = model.get_output_embeddings().weight.detach()
    draft = new_draft(args, shape, head_weight, model.model.norm.weight.detach(), d2t)
    embed = model.get_input_embeddings()
    groups = length_batches([len(s) for s in seqs], args.batch_size)
    gen = torch.Generator().manual_seed(args.seed + 3)
    order: list[int] = []

    def sample(step: int) -> Batch:
        if not order:
            order.extend(torch.randperm(len(groups), generator=gen).tolist())
        return pad_batch(groups[order.pop()], seqs, feats, labels)

    deadline = None if budget is None else _START + budget - 120.0
    train_draft(args, draft, embed, sample, deadline)
    for p in draft.parameters():
        p.requires_grad_(False)
    longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    check_unrolled_matches_inference(
        draft, embed, torch.tensor(seqs[longest]), feats[longest], args.ttt_steps
    )
    save_draft(draft, d2t, t2d, args.output, {"target_num_hidden_layers": cfg.num_hidden_layers})
    log(f"saved {args.output}")
    summary: dict[str, Any] = {"training_tokens": sum(len(s) for s in seqs)}
    if args.no_check:
        return summary

    # 5. Served check: the held-out prompts with and without the head.
    heldout_ids = prompts[n_train:]
    plain = answers[n_train:]
    spec, info = greedy_answers(
        heldout_ids,
        args.answer_tokens,
        model_path=args.model_path,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(args.output),
        speculative_num_steps=args.ttt_steps,
        # Every prompt at once: keep speculation on at that batch, to measure the head.
        speculative_disable_by_batch_size=len(heldout_ids) + 1,
    )
    same = sum(a == b for a, b in zip(plain, spec, strict=True))
    accept = float(info["avg_spec_accept_length"])
    log(f"served held-out prompts: {same}/{len(plain)} equal to plain greedy decoding")
    log(f"mean accept length {accept:.3f} (chain of {args.ttt_steps}, max {args.ttt_steps + 1})")
    return summary | {"heldout_equal": f"{same}/{len(plain)}", "mean_accept_length": accept}


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Denormal floats (tiny Adam moments, softmax tails) slow x86 arithmetic tenfold.
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    train = train_tiny_pair if args.target == "tiny" else train_chat_head
    summary = train(args)
    summary["elapsed_minutes"] = round((time.monotonic() - _START) / 60.0, 2)
    print(json.dumps(summary, indent=2))
    log("done")


if __name__ == "__main__":
    main()
