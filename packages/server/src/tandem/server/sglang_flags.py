"""SGLang's launch options beyond tandem's own flags, so that a ``sglang.launch_server``
line runs unchanged under ``tandem serve`` or says which option stops it.

tandem's flags carry SGLang's names already; this adds SGLang's short aliases, the
options that mean nothing here (accepted, and named once at start), and the ones tandem
does not implement (refused by name, with the reason, instead of argparse's
"unrecognized arguments"). docs/guides/serving.md lists them all.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# SGLang's other names for options tandem has: flag -> tandem's destination.
ALIASES: dict[str, tuple[str, ...]] = {
    "tp_size": ("--tp", "--tensor-parallel-size"),
    "dp_size": ("--dp", "--data-parallel-size"),
    "model_path": ("--model",),
}


@dataclass(frozen=True)
class Foreign:
    """One SGLang option tandem has no field for.

    Attributes:
        flag: SGLang's flag.
        why: what it means here (accepted) or why it is refused.
        value: ``None`` for a switch; else the metavar of its value.
        accept: values (for a switch: the switch itself) that mean nothing here and are
            accepted; any other value is refused. Empty: always refused.
    """

    flag: str
    why: str
    value: str | None = None
    accept: tuple[str, ...] = ()


_ON = ("on",)  # a switch that is accepted

FOREIGN: tuple[Foreign, ...] = (
    # Accepted: nothing to do, or done already.
    Foreign(
        "--trust-remote-code", "tandem runs its own model code, never a checkpoint's", None, _ON
    ),
    Foreign("--enable-metrics", "/metrics is always served", None, _ON),
    Foreign("--enable-cache-report", "usage always reports cached prompt tokens", None, _ON),
    Foreign("--log-requests", "tandem does not log request bodies", None, _ON),
    Foreign("--enable-p2p-check", "tandem's ranks share no GPU memory", None, _ON),
    Foreign("--disable-custom-all-reduce", "tandem uses torch.distributed's all-reduce", None, _ON),
    Foreign("--skip-server-warmup", "tandem warms up inside the engine's start", None, _ON),
    Foreign("--show-time-cost", "step timings are in /get_server_info", None, _ON),
    Foreign(
        "--enable-torch-compile",
        "the forward runs tandem's kernels, CUDA graphs on GPUs and the decode trace on CPUs",
        None,
        _ON,
    ),
    Foreign("--disable-outlines-disk-cache", "tandem's grammars are xgrammar's", None, _ON),
    Foreign("--tokenizer-mode", "tandem always uses the fast tokenizer", "MODE", ("auto", "fast")),
    Foreign("--kv-cache-dtype", "the KV cache has the model's dtype", "DTYPE", ("auto",)),
    Foreign("--stream-interval", "tandem streams every token", "N", ("1",)),
    Foreign("--sampling-backend", "tandem samples with torch", "BACKEND", ("pytorch",)),
    # Refused: not implemented.
    Foreign("--lora-paths", "LoRA adapters are not implemented", "PATH"),
    Foreign("--is-embedding", "embedding models are not served", None),
    Foreign("--enable-multimodal", "tandem serves text models only", None),
    Foreign("--chat-template", "the chat template comes from the checkpoint", "TEMPLATE"),
    Foreign("--reasoning-parser", "reasoning output is not parsed", "PARSER"),
    Foreign("--revision", "pin a Hugging Face revision in the id's cache instead", "REVISION"),
    Foreign("--download-dir", "models download to the Hugging Face cache", "DIR"),
    Foreign("--json-model-override-args", "config overrides are not implemented", "JSON"),
    Foreign("--enable-dp-attention", "data-parallel attention is not implemented", None),
    Foreign("--ep-size", "expert parallelism: tandem serves dense models only", "N"),
    Foreign("--enable-hierarchical-cache", "the radix cache lives in KV memory only", None),
    Foreign("--config", "pass the options as flags", "FILE"),
)


class _ForeignAction(argparse.Action):
    """Records an accepted value for the start-up note; refuses any other by name."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.foreign: Foreign = kwargs.pop("foreign")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        f = self.foreign
        given = "on" if f.value is None else str(values)
        if given not in f.accept:
            shown = f.flag if f.value is None else f"{f.flag} {given}"
            parser.error(
                f"argument {f.flag}: SGLang's {shown} is not implemented by tandem: {f.why}"
            )
        notes = list(getattr(namespace, "sglang_notes", []))
        notes.append(f"{f.flag} has no effect here: {f.why}")
        namespace.sglang_notes = notes


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's options tandem has no field for (``FOREIGN``)."""
    group = parser.add_argument_group(
        "SGLang's options without a tandem field (accepted where they mean nothing here)"
    )
    parser.set_defaults(sglang_notes=[])
    for f in FOREIGN:
        accepted = "accepted" if f.accept else "refused"
        if f.value is not None and f.accept:
            accepted = f"accepted as {' or '.join(f.accept)}, other values refused"
        group.add_argument(
            f.flag, action=_ForeignAction, foreign=f, dest=f"sglang_{f.flag[2:]}",
            nargs=0 if f.value is None else None, metavar=f.value,
            default=argparse.SUPPRESS, help=f"{accepted}: {f.why}",
        )  # fmt: skip
