"""Train a small Llama target model and an EAGLE-3 draft head for it, on the CPU.

The pair exists so speculative decoding can be tested and demonstrated end to end without
downloading anything: a target that has learned real text (so its greedy continuations are
predictable) and a draft head trained on that target's hidden states (so it guesses them).

1. Target: a 4-layer ``LlamaForCausalLM`` trained on ``tools/data/tinyshakespeare.txt``
   (the last 5% of the tokens are held out), tokenized with tandem's byte-level default
   tokenizer. Saved as a Hugging Face folder that ``tandem.scheduler.Engine`` loads.
2. Draft: an EAGLE-3 head (one decoder layer over ``[embedding, hidden]``, fed with three
   of the target's intermediate residual streams) distilled from the target's greedy
   predictions with a 3-step "training-time test" unroll, the way it is used at inference,
   on the training text and on text the target generated itself.
3. Check: on held-out text, a greedy chain speculative decode (3 draft tokens, verified by
   the target) reports the mean accept length (generated tokens per verify step, at most 4).

Weights are written in bfloat16 (safetensors); every run with the same seed, step counts
and thread count writes the same weights. It takes about 11.5 minutes on an idle
2-core machine (``--max-minutes`` is a safety net for a busy one).

Run from the repository root with the dev virtual environment::

    python tools/train_eagle_pair.py

(``.venv/bin/python tools/train_eagle_pair.py``); ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import math
import time
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
DEFAULT_OUTPUT = REPO_ROOT / "tools" / "eagle_pair"

# Target shape (Llama field names).
HIDDEN = 192
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 48
INTERMEDIATE = 512
MAX_POSITIONS = 1024
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
# Residual streams the draft reads: outputs of decoder layers 0, 1 and 2 (never the last).
AUX_LAYERS = (0, 1, 2)
DRAFT_VOCAB = 256
DRAFT_INTERMEDIATE = 512
# The draft is unrolled over this many steps in training; at inference it proposes as many
# tokens per verify step (one from the target-feature pass, then two recursive steps).
DRAFT_STEPS = 3
STEP_WEIGHTS = (1.0, 0.8, 0.64)
HOLDOUT_FRACTION = 0.05

_START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="output folder")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="training text")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seq-len", type=int, default=256, help="training window, tokens")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--target-steps", type=int, default=400, help="target optimizer steps")
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-steps", type=int, default=500, help="draft optimizer steps")
    parser.add_argument("--draft-lr", type=float, default=4e-3)
    parser.add_argument(
        "--self-distill",
        type=int,
        default=256,
        help="extra draft training windows written by the target itself (greedy "
        "continuations of training-text prompts), the text the draft sees at inference",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=14.0,
        help="safety net for a busy machine: the target stops early past 55%% of this "
        "budget, the draft one minute before its end (time left to check and save). "
        "An idle 2-core machine needs about 11.5 minutes, so the default never cuts in "
        "and the step counts alone decide the weights; a run it cuts short says so and "
        "is not reproducible. 0 disables it",
    )
    parser.add_argument("--eval-prompts", type=int, default=24, help="spec-decode prompts")
    parser.add_argument("--eval-new-tokens", type=int, default=96)
    return parser.parse_args()


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
def target_pass(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy next-token ids ``[B, T]`` and the draft's input features ``[B, T, 3H]``."""
    out = model(input_ids=ids, output_hidden_states=True)
    # hidden_states[0] is the embedding output, hidden_states[i + 1] layer i's output.
    aux = torch.cat([out.hidden_states[i + 1] for i in AUX_LAYERS], dim=-1)
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


def rope_tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (
        ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM)
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
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS))


class DraftAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(2 * HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(2 * HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)


class DraftMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, DRAFT_INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, DRAFT_INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(DRAFT_INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.hidden_norm = RMSNorm(HIDDEN)
        self.self_attn = DraftAttention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = DraftMLP()


class Eagle3Draft(nn.Module):
    """The draft head; its parameter names are the checkpoint's tensor names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * HIDDEN, HIDDEN, bias=False)
        self.midlayer = DraftLayer()
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, DRAFT_VOCAB, bias=False)

    def project(
        self, x: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, nh, T, hd]``, k and v ``[B, nkv, T, hd]`` of inputs ``x`` and ``emb``."""
        layer = self.midlayer
        z = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(x)], dim=-1)
        b, t, _ = z.shape
        q = layer.self_attn.q_proj(z).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = layer.self_attn.k_proj(z).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = layer.self_attn.v_proj(z).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = rope_tables(positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, res: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, o_proj, MLP block: the step's output hidden state ``[B, T, H]``."""
        layer = self.midlayer
        b, _, t, _ = attn.shape
        x = res + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))
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

    @staticmethod
    def _unrolled_attention(
        q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], step: int
    ) -> torch.Tensor:
        t = q.shape[2]
        rep = HEADS // KV_HEADS
        scale = HEAD_DIM**-0.5
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
        self, aux: torch.Tensor, emb_next: torch.Tensor, embed: nn.Embedding, d2t: torch.Tensor
    ) -> list[int]:
        """Inference on one sequence, as the engine runs it: draft-extend over the committed
        positions 0..L-1 (``aux [L, 3H]``, ``emb_next [L, H]`` = embeddings of tokens 1..L),
        then ``DRAFT_STEPS - 1`` recursive steps; returns ``DRAFT_STEPS`` target token ids
        (guesses for positions L + 1, L + 2, ...)."""
        length = aux.shape[0]
        x = self.fc(aux[None])
        q, k, v = self.project(x, emb_next[None], torch.arange(length))
        keys, values = [k], [v]
        hid = self.finish(x, self._attend_all(q, keys, values, causal=True))[:, -1:]
        guesses = [self._guess(hid, d2t)]
        for s in range(1, DRAFT_STEPS):
            position = torch.tensor([length - 1 + s])
            q, k, v = self.project(hid, embed(torch.tensor([[guesses[-1]]])), position)
            keys.append(k)
            values.append(v)
            hid = self.finish(hid, self._attend_all(q, keys, values, causal=False))
            guesses.append(self._guess(hid, d2t))
        return guesses

    def _guess(self, hid: torch.Tensor, d2t: torch.Tensor) -> int:
        draft_id = int(self.logits(hid)[0, -1].argmax())
        return draft_id + int(d2t[draft_id])

    @staticmethod
    def _attend_all(
        q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], causal: bool
    ) -> torch.Tensor:
        rep = HEADS // KV_HEADS
        k = torch.cat(keys, dim=2).repeat_interleave(rep, dim=1)
        v = torch.cat(values, dim=2).repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) * HEAD_DIM**-0.5
        if causal:
            t = q.shape[2]
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores.float(), dim=-1) @ v


def draft_vocabulary(train_ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``DRAFT_VOCAB`` most frequent target ids (ties: lower id), sorted by id.

    Returns ``d2t`` (``target = draft + d2t[draft]``) and ``t2d`` (bool, target in vocab).
    """
    counts = torch.bincount(train_ids, minlength=vocab)
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    kept = torch.tensor(sorted(order[:DRAFT_VOCAB]), dtype=torch.long)
    d2t = kept - torch.arange(DRAFT_VOCAB)
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


def train_draft(
    args: argparse.Namespace,
    draft: Eagle3Draft,
    embed: nn.Embedding,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    labels: torch.Tensor,
    deadline: float | None,
) -> None:
    gen = torch.Generator().manual_seed(args.seed + 3)
    opt = torch.optim.AdamW(
        draft.parameters(), lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    steps = args.draft_steps
    t = tokens.shape[1]
    rows = torch.arange(t)[None, :]
    draft.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.draft_lr, warmup=min(50, steps // 10 + 1))
        pick = torch.randint(0, len(tokens), (args.batch_size,), generator=gen)
        emb = next_embeddings(embed, tokens[pick])
        logits = draft.unrolled(aux[pick], emb, DRAFT_STEPS)
        loss = torch.zeros(())
        accs = []
        for s, step_logits in enumerate(logits):
            lab = labels[pick].masked_fill(rows < s, -100)
            loss = loss + STEP_WEIGHTS[s] * F.cross_entropy(
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
    draft: Eagle3Draft, embed: nn.Embedding, tokens: torch.Tensor, aux: torch.Tensor
) -> None:
    """The training unroll and the step-by-step inference path compute the same thing."""
    emb = next_embeddings(embed, tokens[None])
    logits = draft.unrolled(aux[None], emb, DRAFT_STEPS)
    worst = 0.0
    for root in (3, 40, 101):
        # Step s at position root + s reads the real token root + s + 1 in training; feed
        # the same tokens as "guesses" to the inference path.
        length = root + 1
        x = draft.fc(aux[None, :length])
        q, k, v = draft.project(x, emb[:, :length], torch.arange(length))
        keys, values = [k], [v]
        hid = draft.finish(x, draft._attend_all(q, keys, values, causal=True))[:, -1:]
        worst = max(worst, float((draft.logits(hid)[0, 0] - logits[0][0, root]).abs().max()))
        for s in range(1, DRAFT_STEPS):
            pos = root + s
            q, k, v = draft.project(
                hid, embed(tokens[None, pos + 1 : pos + 2]), torch.tensor([pos])
            )
            keys.append(k)
            values.append(v)
            hid = draft.finish(hid, draft._attend_all(q, keys, values, causal=False))
            worst = max(worst, float((draft.logits(hid)[0, 0] - logits[s][0, pos]).abs().max()))
    if worst > 1e-3:
        raise AssertionError(f"training unroll and inference disagree (max |diff| {worst:.2e})")
    log(f"unrolled training forward matches step-by-step inference (max |diff| {worst:.1e})")


@torch.no_grad()
def simulate_speculative_decoding(
    target: LlamaForCausalLM,
    draft: Eagle3Draft,
    d2t: torch.Tensor,
    eval_ids: torch.Tensor,
    prompts: int,
    prompt_len: int,
    new_tokens: int,
) -> float:
    """Greedy chain speculative decoding on held-out prompts; the mean accept length.

    Each round: the draft extends over the committed tokens (target features at every
    committed position, the pending bonus token as the last input), proposes
    ``DRAFT_STEPS`` tokens, the target scores them in one pass, the longest prefix that
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
            guesses = draft.propose(features, emb_next, embed, d2t)
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


def draft_config_dict(vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": DRAFT_INTERMEDIATE,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "draft_vocab_size": DRAFT_VOCAB,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS)},
    }


def save_draft(
    draft: Eagle3Draft, d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, folder: Path
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in draft.state_dict().items()
    }
    state["d2t"] = d2t.to(torch.int64).contiguous()
    state["t2d"] = t2d.to(torch.bool).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", draft_config_dict(vocab))


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Denormal floats (tiny Adam moments, softmax tails) slow x86 arithmetic tenfold.
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    budget = args.max_minutes * 60.0 if args.max_minutes > 0 else None
    tokenizer, train_ids, eval_ids = load_tokens(args.text)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
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
    d2t, t2d = draft_vocabulary(train_ids, vocab)
    target_to_draft = torch.full((vocab,), -100, dtype=torch.long)
    target_to_draft[t2d] = torch.arange(DRAFT_VOCAB)
    labels = draft_labels(greedy, target_to_draft)
    coverage = (labels[:, :-1] != -100).float().mean().item()
    log(f"draft data: {len(tokens)} windows; draft vocab covers {coverage:.4f} of the labels")

    # 3. Draft.
    torch.manual_seed(args.seed + 10)
    draft = Eagle3Draft()
    with torch.no_grad():
        # Warm start: the target's own output head (draft-vocabulary rows) and final norm.
        draft.lm_head.weight.copy_(target.lm_head.weight[torch.arange(DRAFT_VOCAB) + d2t])
        draft.norm.weight.copy_(target.model.norm.weight)
    embed = target.get_input_embeddings()
    log(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters")
    deadline = None if budget is None else _START + budget - 60.0
    train_draft(args, draft, embed, tokens, aux, labels, deadline)
    for p in draft.parameters():
        p.requires_grad_(False)
    check_unrolled_matches_inference(draft, embed, tokens[0], aux[0])
    save_draft(draft, d2t, t2d, vocab, args.output / "eagle3")
    log(f"saved {args.output / 'eagle3'}")

    # 4. Check.
    accept = simulate_speculative_decoding(
        target, draft, d2t, eval_ids, args.eval_prompts, 64, args.eval_new_tokens
    )
    log(f"simulated greedy speculative decoding ({DRAFT_STEPS} draft tokens, held-out prompts):")
    log(f"mean accept length {accept:.3f} tokens per verify step (max {DRAFT_STEPS + 1})")
    summary = {
        "target_train_loss": round(losses["train_loss"], 4),
        "target_heldout_loss": round(losses["heldout_loss"], 4),
        "mean_accept_length": round(accept, 4),
        "elapsed_minutes": round((time.monotonic() - _START) / 60.0, 2),
    }
    print(json.dumps(summary, indent=2))
    log("done")


if __name__ == "__main__":
    main()
