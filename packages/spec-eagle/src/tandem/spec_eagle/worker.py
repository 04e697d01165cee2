"""The overlap-compatible EAGLE worker: draft -> verify -> publish -> draft-extend -> stash.

One ``EagleWorker.decode`` call is one speculative step for a batch of rows: resolve
each row's committed length, root token and draft state (relay fields) from the
FutureMap, draft a tree, verify it in one target forward, accept and publish the new
lengths, move the accepted KV into place (trees only), draft-extend over the committed
tokens, and stash the bonus and the new draft state. All of it is device work on the
forward stream with fixed shapes; the host learns the accepted counts one iteration
later. See docs/guides/speculative-decoding.md, "How a step keeps the overlap".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from tandem.futuremap import RelayField
from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.attention.torch_backend import TorchAttention
from tandem.scheduler.config import EngineConfig
from tandem.scheduler.kv.pools import KVLayout
from tandem.scheduler.messages import GrammarMasks
from tandem.scheduler.models import ModelConfig
from tandem.scheduler.sampling import SamplingBatchInfo, SamplingParams
from tandem.scheduler.sampling.sampler import filtered_probs
from tandem.scheduler.speculative.interface import (
    PrefillDraftInput,
    SpecDecodeInput,
    SpecDecodeOutput,
    TargetHandle,
)
from tandem.spec_eagle.accept import Accepted, accept_greedy, accept_sampled
from tandem.spec_eagle.draft_kv import DraftKVCache
from tandem.spec_eagle.draft_model import EagleDraftModel, load_draft_model
from tandem.spec_eagle.tree import Candidates, DraftTree, select_tree

BUILT_IN_HEAD = Path(__file__).resolve().parent / "heads" / "smollm2"
"""The EAGLE-3 head for the default model, SmolLM2-135M-Instruct, trained by
``tools/train_eagle.py chat``: used when no ``speculative_draft_model_path`` is given."""


class EagleWorker:
    """EAGLE / EAGLE-3 speculative decoding, chain (topk = 1) or tree (topk > 1)."""

    def __init__(self, config: EngineConfig, target: TargetHandle) -> None:
        assert config.speculative_num_steps
        assert config.speculative_eagle_topk
        assert config.speculative_num_draft_tokens
        if type(target.attention).plan_masked is AttentionBackend.plan_masked:
            raise ValueError(
                f"speculative decoding needs custom-mask attention, which the "
                f"{type(target.attention).__name__} backend lacks; use "
                "attention_backend='torch' or 'triton'"
            )
        self.target = target
        self.num_steps = config.speculative_num_steps
        self.topk = config.speculative_eagle_topk
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.max_accept = config.speculative_max_accept
        self.lookahead = config.speculative_lookahead
        self.draft: EagleDraftModel = load_draft_model(
            config.speculative_draft_model_path or built_in_head(target.model_config),
            target.model,
            algorithm=config.speculative_algorithm,
            dtype=target.dtype,
            device=target.device,
        )
        self.draft.quantize_int8()  # on the CPU (see there)
        dc = self.draft.config
        self.algorithm = dc.algorithm
        self.capture_layers: tuple[int, ...] = dc.aux_layers
        kv = target.kv_pool
        self.kv = DraftKVCache(
            num_slots=kv.num_pages * kv.page_size,
            num_rows=target.req_pool.num_rows,
            scratch_per_row=max(1, self.topk * (self.num_steps - 1)),
            layout=KVLayout(
                dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, target.dtype
            ),
            page_size=kv.page_size,
            device=target.device,
        )
        self.draft_attention = TorchAttention(self.kv, target.req_pool.req_to_token)
        self.relay_fields: tuple[RelayField, ...] = (
            RelayField("topk_p", (self.topk,), torch.float32),
            RelayField("topk_index", (self.topk,), torch.int64),
            RelayField("hidden_states", (dc.hidden_size,), target.dtype),
        )
        self._target_max_pos = target.model_config.max_position_embeddings - 1

    # -- the scheduler's questions ------------------------------------------------------------
    def check_request(self, params: SamplingParams, return_logprob: bool) -> None:
        if params.uses_penalties:
            raise ValueError(
                "repetition, frequency and presence penalties are not supported with "
                "speculative decoding"
            )
        if return_logprob or params.return_logprob or params.top_logprobs_num:
            raise ValueError("logprobs are not supported with speculative decoding")

    # -- after a target prefill -----------------------------------------------------------------
    def extend_after_prefill(self, data: PrefillDraftInput) -> None:
        fb = data.batch
        self.draft_attention.plan(fb)
        positions = fb.positions.clamp(max=self.draft.max_position)
        hidden = self.draft(data.next_ids, data.features, positions, self.draft_attention)
        if data.sample_rows.numel() == 0:
            return
        last = hidden.index_select(0, data.sample_last)
        topk_p, topk_index = self._top(last)
        fm = self.target.future_map
        fm.stash(data.sample_rows, None, topk_p=topk_p, topk_index=topk_index, hidden_states=last)
        fm.publish(data.sample_rows, data.sample_seq_lens)

    # -- one speculative step ------------------------------------------------------------------
    def decode(self, data: SpecDecodeInput) -> SpecDecodeOutput:
        fm = self.target.future_map
        rows = data.rows
        seq_lens = fm.resolve_seq_lens(rows)
        root = fm.resolve_tokens(rows)
        relay = fm.resolve_relay(rows, "topk_p", "topk_index", "hidden_states")
        span = max(data.bounds)  # no row's committed length exceeds it
        # The rows' slot table, gathered once per step: every piece below reads it,
        # and no write to it is queued inside the step.
        table = self.target.req_pool.req_to_token.index_select(0, rows)
        table = table[:, : span + self.lookahead].long()
        tree = self._draft_tree(rows, table, seq_lens, span, root, relay)
        logits, features = self._verify(table, seq_lens, span, tree)
        if data.grammar is not None:
            _mask_tree(tree, logits, data.grammar)
        accepted = self._accept(tree, logits, data)
        new_lens = seq_lens + accepted.num_accepted + 1
        fm.publish(rows, new_lens)
        if self.topk > 1:
            self._move_accepted_kv(table, seq_lens, accepted)
        tokens = self._committed_tokens(tree, accepted)
        hidden, topk_p, topk_index = self._extend(table, seq_lens, span, tokens, features, accepted)
        fm.stash(rows, accepted.bonus, topk_p=topk_p, topk_index=topk_index, hidden_states=hidden)
        return SpecDecodeOutput(tokens=tokens, accept_lens=accepted.num_accepted + 1)

    # -- pieces -----------------------------------------------------------------------------
    def _top(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's ``topk`` next tokens (target ids) and their probabilities."""
        probs = torch.softmax(self.draft.compute_logits(hidden), dim=-1)
        values, index = torch.topk(probs, self.topk, dim=-1)
        return values, self.draft.to_target_ids(index)

    @staticmethod
    def _position_slots(table: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
        """``[B, count]`` KV slots of positions ``start .. start + count - 1``."""
        cols = start.unsqueeze(1) + torch.arange(count, device=start.device)
        return table.gather(1, cols)

    def _draft_tree(
        self,
        rows: torch.Tensor,
        table: torch.Tensor,
        seq_lens: torch.Tensor,
        span: int,
        root: torch.Tensor,
        relay: dict[str, torch.Tensor],
    ) -> DraftTree:
        """The tree of ``num_steps`` levels below the root: the relay's ``topk``
        children, then ``num_steps - 1`` draft forwards over the beam."""
        b, k = rows.numel(), self.topk
        device = rows.device
        beam_tokens = relay["topk_index"]  # [B, k] the root's drafted children
        beam_scores = relay["topk_p"].float()
        beam_ids = torch.arange(1, k + 1, device=device).expand(b, k)
        beam_hidden = relay["hidden_states"].unsqueeze(1).expand(b, k, -1)
        tokens, scores = [beam_tokens], [beam_scores]
        parents = [torch.zeros(b, k, dtype=torch.int64, device=device)]
        depths = [torch.ones(b, k, dtype=torch.int64, device=device)]
        next_id = k + 1
        scratch = self.kv.scratch_slots(rows)  # [B, S]
        seen = torch.zeros(b, k, scratch.shape[1], dtype=torch.bool, device=device)
        prefix = table[:, :span]
        visible_prefix = torch.arange(span, device=device) < seq_lens.unsqueeze(1)  # [B, P]
        for depth in range(1, self.num_steps):
            # The beam (k nodes at this depth) runs at draft position L + depth - 1.
            own = torch.zeros(k, scratch.shape[1], dtype=torch.bool, device=device)
            own[torch.arange(k), (depth - 1) * k + torch.arange(k)] = True
            visible = seen | own
            mask = torch.cat([visible_prefix.unsqueeze(1).expand(b, k, span), visible], dim=2)
            out_loc = scratch[:, (depth - 1) * k : depth * k].reshape(-1)
            self.draft_attention.plan_masked(torch.cat([prefix, scratch], dim=1), mask, out_loc)
            positions = (seq_lens + depth - 1).clamp(max=self.draft.max_position)
            hidden = self.draft(
                beam_tokens.reshape(-1),
                beam_hidden.reshape(b * k, -1),
                positions.repeat_interleave(k),
                self.draft_attention,
            )
            p, child = self._top(hidden)  # [B * k, k]
            child_scores = (beam_scores.unsqueeze(2) * p.view(b, k, k)).reshape(b, k * k)
            child_tokens = child.view(b, k * k)
            child_ids = torch.arange(next_id, next_id + k * k, device=device).expand(b, k * k)
            next_id += k * k
            tokens.append(child_tokens)
            scores.append(child_scores)
            parents.append(beam_ids.repeat_interleave(k, dim=1))
            depths.append(torch.full((b, k * k), depth + 1, dtype=torch.int64, device=device))
            if depth == self.num_steps - 1:
                break
            best = torch.topk(child_scores, k, dim=1).indices  # the next beam
            parent_slot = best // k
            beam_tokens = child_tokens.gather(1, best)
            beam_scores = child_scores.gather(1, best)
            beam_ids = child_ids.gather(1, best)
            beam_hidden = hidden.view(b, k, -1).gather(
                1, parent_slot.unsqueeze(2).expand(b, k, hidden.shape[-1])
            )
            seen = visible.gather(1, parent_slot.unsqueeze(2).expand(b, k, visible.shape[2]))
        cands = Candidates(
            torch.cat(tokens, dim=1),
            torch.cat(scores, dim=1),
            torch.cat(parents, dim=1),
            torch.cat(depths, dim=1),
        )
        return select_tree(root, cands, self.num_draft_tokens, self.num_steps)

    def _verify(
        self, table: torch.Tensor, seq_lens: torch.Tensor, span: int, tree: DraftTree
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the tree: ``[B, N, V]`` logits, ``[B, N, F]`` features.
        Node ``i`` is written at position slot ``L + i`` with RoPE position
        ``L + depth(i)``, masked to its ancestors."""
        b, n = tree.tokens.shape
        device = table.device
        width = span + n
        keys = torch.arange(width, device=device)
        rel = keys.unsqueeze(0) - seq_lens.unsqueeze(1)  # [B, K] key position - L
        in_tree = (rel >= 0) & (rel < n)
        tree_part = tree.ancestors.gather(
            2, rel.clamp(0, n - 1).unsqueeze(1).expand(b, n, width)
        ) & in_tree.unsqueeze(1)
        mask = (rel < 0).unsqueeze(1) | tree_part
        out_loc = self._position_slots(table, seq_lens, n).reshape(-1)
        attention = self.target.attention
        attention.plan_masked(table[:, :width], mask, out_loc)
        positions = (seq_lens.unsqueeze(1) + tree.depths).clamp(max=self._target_max_pos)
        model = self.target.model
        hidden, captured = model.forward_capture(
            tree.tokens.reshape(-1), positions.reshape(-1), attention, self.capture_layers
        )
        features = torch.cat(captured, dim=-1) if captured else hidden
        logits = model.compute_logits(hidden)
        return logits.view(b, n, -1), features.view(b, n, -1)

    def _accept(self, tree: DraftTree, logits: torch.Tensor, data: SpecDecodeInput) -> Accepted:
        info = data.sampling
        greedy = accept_greedy(tree, logits.argmax(dim=-1), self.max_accept)
        if info.all_greedy:
            return greedy
        b, n, v = logits.shape
        probs = filtered_probs(logits.reshape(b * n, v), _per_node(info, n)).view(b, n, v)
        uniforms = self._uniforms(info, data.steps, b, logits.device)
        sampled = accept_sampled(tree, probs, uniforms, self.max_accept, self.topk)
        if not info.any_greedy:
            return sampled
        pick = info.greedy
        return Accepted(
            torch.where(pick.unsqueeze(1), greedy.path, sampled.path),
            torch.where(pick, greedy.num_accepted, sampled.num_accepted),
            torch.where(pick, greedy.bonus, sampled.bonus),
        )

    def _uniforms(
        self, info: SamplingBatchInfo, steps: list[int], b: int, device: torch.device
    ) -> torch.Tensor:
        """One uniform per sibling trial plus one for the bonus draw, per row. Seeded
        requests get theirs from ``(seed, step, trial)`` alone, so a seeded speculative
        run repeats whatever else is in the batch."""
        count = (self.max_accept - 1) * self.topk + 1
        gen = self.target.sampler.generator(device)
        drawn = torch.rand(b, count, dtype=torch.float64, device=device, generator=gen)
        if not any(seed is not None for seed in info.seeds):
            return drawn
        fixed = [
            [_seeded_uniform(seed, step, j) for j in range(count)]
            if seed is not None
            else [0.0] * count
            for seed, step in zip(info.seeds, steps, strict=True)
        ]
        seeded = torch.tensor(fixed, dtype=torch.float64).to(device, non_blocking=True)
        return torch.where(info.seeded.unsqueeze(1), seeded, drawn)

    def _move_accepted_kv(
        self, table: torch.Tensor, seq_lens: torch.Tensor, accepted: Accepted
    ) -> None:
        """Tree nodes were written at slots ``L + node``; the accepted path must sit at
        ``L + depth``. Gather every source first, so overlapping moves read old data."""
        g = self.max_accept
        depth = torch.arange(g, device=table.device).unsqueeze(0)
        src = table.gather(1, seq_lens.unsqueeze(1) + accepted.path)
        dst = table.gather(1, seq_lens.unsqueeze(1) + depth)
        src = torch.where(depth <= accepted.num_accepted.unsqueeze(1), src, dst).reshape(-1)
        dst = dst.reshape(-1)
        kv = self.target.kv_pool
        for layer in range(self.target.model_config.num_hidden_layers):
            for buf in (kv.k_buffer(layer), kv.v_buffer(layer)):
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def _committed_tokens(self, tree: DraftTree, accepted: Accepted) -> torch.Tensor:
        """``[B, max_accept]``: the accepted drafts, then the bonus (repeated as padding)."""
        path_tokens = tree.tokens.gather(1, accepted.path)[:, 1:]
        bonus = accepted.bonus.unsqueeze(1)
        shifted = torch.cat([path_tokens, bonus], dim=1)
        col = torch.arange(self.max_accept, device=bonus.device).unsqueeze(0)
        return torch.where(col < accepted.num_accepted.unsqueeze(1), shifted, bonus)

    def _extend(
        self,
        table: torch.Tensor,
        seq_lens: torch.Tensor,
        span: int,
        tokens: torch.Tensor,
        features: torch.Tensor,
        accepted: Accepted,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft over the committed tokens at positions ``L .. L + max_accept - 1``
        (position ``L + j`` reads token ``L + j + 1`` and the target's features at the
        accepted node of depth ``j``); returns the new draft state of each row. The
        committed tokens are padded to ``max_accept``: padding writes only past the new
        length, where nothing reads."""
        b, g = tokens.shape
        device = table.device
        width = span + g
        keys = torch.arange(width, device=device).view(1, 1, width)
        query_pos = seq_lens.view(b, 1, 1) + torch.arange(g, device=device).view(1, g, 1)
        mask = keys <= query_pos  # causal over the prefix and the committed tokens
        out_loc = self._position_slots(table, seq_lens, g).reshape(-1)
        self.draft_attention.plan_masked(table[:, :width], mask, out_loc)
        feats = features.gather(1, accepted.path.unsqueeze(2).expand(b, g, features.shape[2]))
        positions = query_pos.view(b, g).clamp(max=self.draft.max_position)
        hidden = self.draft(
            tokens.reshape(-1),
            feats.reshape(b * g, -1),
            positions.reshape(-1),
            self.draft_attention,
        ).view(b, g, -1)
        last = hidden.gather(
            1, accepted.num_accepted.view(b, 1, 1).expand(b, 1, hidden.shape[2])
        ).squeeze(1)
        topk_p, topk_index = self._top(last)
        return last, topk_p, topk_index


def _per_node(info: SamplingBatchInfo, n: int) -> SamplingBatchInfo:
    """A batch's sampling configuration repeated for each of its ``n`` tree nodes."""

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(n, dim=0)

    return dataclasses.replace(
        info,
        rows=rep(info.rows),
        temperatures=rep(info.temperatures),
        top_ps=rep(info.top_ps),
        top_ks=rep(info.top_ks),
        min_ps=rep(info.min_ps),
        greedy=rep(info.greedy),
        uniforms=rep(info.uniforms),
        seeded=rep(info.seeded),
        seeds=tuple(s for s in info.seeds for _ in range(n)),
        steps=tuple(s for s in info.steps for _ in range(n)),
    )


def _mask_tree(tree: DraftTree, logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Mask each constrained row's node logits ``[B, N, V]`` (in place) by what its
    grammar allows after the node's path from the root: accept the path's draft tokens,
    write the mask, roll back. A node whose path the grammar refuses is left unmasked:
    verification stops before it anyway, at the parent whose masked logits cannot pick
    the refused token. The matchers come back as they were handed over."""
    from tandem.scheduler.sampling.grammar import apply_bitmask  # xgrammar: on first use

    masks.ready.wait()  # the host has processed every step before this one
    assert masks.matchers is not None
    b, n, v = logits.shape
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    bitmask = torch.full((len(masks.rows) * n, masks.bitmask.shape[1]), -1, dtype=torch.int32)
    flat: list[int] = []
    for row, matcher in zip(masks.rows, masks.matchers, strict=True):
        if matcher is None:
            continue  # ended meanwhile: its tokens are discarded
        for node in range(n):
            path = []
            at = node
            while at != 0:
                path.append(tokens[row][at])
                at = parents[row][at]
            taken = 0
            for token in reversed(path):
                if not matcher.accept(token):
                    break
                taken += 1
            if taken == len(path):
                matcher.fill(bitmask, len(flat))
            matcher.rollback(taken)
            flat.append(row * n + node)
    apply_bitmask(logits.view(b * n, v), bitmask[: len(flat)].to(logits.device), flat)


def _seeded_uniform(seed: int, step: int, trial: int) -> float:
    digest = hashlib.blake2b(f"{seed}:spec:{step}:{trial}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def built_in_head(target: ModelConfig) -> str:
    """The folder of the head ``tandem-spec-eagle`` ships for the default model, when
    ``target`` has that model's shape; else a ``ValueError`` asking for a head."""
    config = BUILT_IN_HEAD / "config.json"
    if not config.is_file():
        raise ValueError(
            f"speculative_draft_model_path is needed: this install of tandem-spec-eagle has "
            f"no built-in head ({BUILT_IN_HEAD}); `python tools/train_eagle.py chat` builds it"
        )
    head = json.loads(config.read_text(encoding="utf-8"))
    fits = (
        head["hidden_size"] == target.hidden_size
        and head["vocab_size"] == target.vocab_size
        and max(head["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) < target.num_hidden_layers
        and target.num_hidden_layers == head["target_num_hidden_layers"]
    )
    if not fits:
        raise ValueError(
            "speculative_draft_model_path is needed: the built-in head is for the default "
            f"model, SmolLM2-135M-Instruct (hidden {head['hidden_size']}, vocabulary "
            f"{head['vocab_size']}, {head['target_num_hidden_layers']} layers), not this "
            f"target (hidden {target.hidden_size}, vocabulary {target.vocab_size}, "
            f"{target.num_hidden_layers} layers)"
        )
    return str(BUILT_IN_HEAD)


def create_worker(config: EngineConfig, target: TargetHandle) -> EagleWorker:
    """The ``tandem.speculative_algorithms`` entry point of ``EAGLE`` and ``EAGLE3``."""
    return EagleWorker(config, target)
