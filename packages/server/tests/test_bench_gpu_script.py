"""``tools/bench_gpu.py`` on the CPU: its model configs, its byte counts, and a ``--quick``
run on a tiny config whose JSON must hold every section with sane numbers.

The script is meant for a GPU; this keeps it runnable between GPU runs. The tiny config
is the Llama-3.2-1B one shrunk (same family, llama3 rope scaling, tied embeddings).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from tandem.scheduler.models import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import HOOK, ROOT, load_module

SCRIPT = ROOT / "tools" / "bench_gpu.py"
CONFIGS = ROOT / "benchmarks" / "configs"


def test_configs_are_the_real_llama_shapes() -> None:
    """The engine's loader reads both configs, and the script's parameter count from the
    config matches the published sizes (1,235,814,400 and 8,030,261,248)."""
    bench = load_module(SCRIPT, "bench_gpu_under_test")
    small = ModelConfig.from_pretrained(CONFIGS / "llama-3.2-1b")
    large = ModelConfig.from_pretrained(CONFIGS / "llama-3.1-8b")
    for mc, hidden, layers, head_dim, inter, factor, tied in (
        (small, 2048, 16, 64, 8192, 32.0, True),
        (large, 4096, 32, 128, 14336, 8.0, False),
    ):
        assert mc.architecture == "LlamaForCausalLM"
        assert (mc.hidden_size, mc.num_hidden_layers, mc.head_dim) == (hidden, layers, head_dim)
        assert (mc.num_attention_heads, mc.num_key_value_heads) == (32, 8)
        assert (mc.intermediate_size, mc.vocab_size) == (inter, 128256)
        assert mc.rope_theta == 500000.0
        assert mc.max_position_embeddings == 131072
        assert mc.rope_scaling == {
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        }
        assert mc.tie_word_embeddings is tied
        assert (mc.dtype, mc.rms_norm_eps, mc.bos_token_id, mc.eos_token_id) == (
            "bfloat16",
            1e-5,
            128000,
            (128001,),
        )
    small_w = bench.weight_bytes(small, 2)
    large_w = bench.weight_bytes(large, 2)
    assert small_w["parameters"] == 1_235_814_400
    assert large_w["parameters"] == 8_030_261_248
    # tied: the embedding is the head, read every step; untied: the embedding is not read
    assert small_w["parameters_read_per_step"] == small_w["parameters"]
    assert large_w["parameters_read_per_step"] == 8_030_261_248 - 128256 * 4096
    assert bench.kv_bytes_per_token(large, 2) == 32 * 2 * 8 * 128 * 2


def _tiny_config(folder: Path) -> None:
    config = json.loads((CONFIGS / "llama-3.2-1b" / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))


def _positive(value: Any, where: str) -> None:
    assert isinstance(value, int | float), where
    assert not isinstance(value, bool), where
    assert math.isfinite(value), f"{where}: {value}"
    assert value > 0, f"{where}: {value}"


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} in the results file: JSON has no such number")


def _fraction(value: Any, where: str) -> None:
    assert isinstance(value, float), f"{where}: {value!r}"
    assert 0.0 <= value <= 1.0, f"{where}: {value}"


def test_quick_cpu_run(tmp_path: Path) -> None:
    _tiny_config(tmp_path / "configs" / "tiny")
    command = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--quick",
        "--config-dir",
        str(tmp_path / "configs"),
        "--models",
        "tiny",
        "--batch-sizes",
        "1,2",
        "--out",
        str(tmp_path / "out" / "bench-gpu-{model}.json"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "utilisation" in done.stdout  # the table at the end
    path = tmp_path / "out" / "bench-gpu-tiny.json"
    report = json.loads(path.read_text(), parse_constant=_no_constant)

    assert report["benchmark"] == "bench_gpu"
    assert report["model"] == "tiny"
    assert report["command"].startswith("python tools/bench_gpu.py --device cpu --quick")
    env = report["environment"]
    assert env["device"] == "cpu"
    assert env["torch"]
    assert env["date"]
    _positive(report["config"]["parameters"], "config.parameters")

    bandwidth = report["bandwidth"]
    _positive(bandwidth["bytes_per_s"], "bandwidth")
    assert bandwidth["bytes_moved"] == 2 * bandwidth["copy_bytes"]

    decode = report["decode"]
    weights = decode["weights"]
    assert weights["engine_parameters"] == weights["parameters"] == report["config"]["parameters"]
    rows = decode["rows"]
    assert [(r["batch_size"], r["cuda_graph"]) for r in rows] == [(1, False), (2, False)]
    for row in rows:
        for key in ("measured_s", "roofline_s", "bandwidth_utilisation", "kv_bytes"):
            _positive(row[key], f"decode B={row['batch_size']} {key}")
        assert math.isclose(row["bandwidth_utilisation"], row["roofline_s"] / row["measured_s"])
        # the decode steps counted are the ones asked for, all on cached prompts
        assert row["decode_steps_counted"] == [decode["decode_steps"]]
        assert row["cached_prompt_fraction"] > 0.9

    overlap = report["overlap"]
    for loop in ("overlap", "normal"):
        run = overlap[loop]
        _positive(run["output_throughput"], f"overlap.{loop}")
        assert (
            run["output_tokens"]
            == overlap["workload"]["requests"] * (overlap["workload"]["output_len"])
        )
        _fraction(run["device_idle_fraction"], f"overlap.{loop} idle")
    _positive(overlap["overlap_vs_normal"], "overlap_vs_normal")

    idle = report["idle"]
    assert idle["profiler_idle_fraction"] is None  # no CUDA: the timeline only
    assert idle["window_decode_steps"] > 0
    _fraction(idle["timeline_idle_fraction_window"], "idle window")
    _fraction(idle["timeline_idle_fraction_run"], "idle run")

    versus = report["transformers"]
    _positive(versus["tandem"]["output_throughput"], "tandem")
    _positive(versus["transformers"]["output_throughput"], "transformers")
    _positive(versus["tandem_vs_transformers"], "tandem_vs_transformers")
    wanted = versus["workload"]["requests"] * versus["workload"]["output_len"]
    assert versus["tandem"]["output_tokens"] == versus["transformers"]["output_tokens"] == wanted

    _check_docs_hook_reads(path)


def _check_docs_hook_reads(path: Path) -> None:
    """The docs build reads these files with its own checks: the script's output must
    pass them and render."""
    hook = load_module(HOOK, "bench_figures_under_test")
    result = hook._load(path, ROOT)
    assert result.kind == "bench_gpu"
    table = hook._gpu_table([result])
    assert "| 2 | off |" in table
    assert "tiny" in hook._gpu_summary([result])
    assert hook._gpu_plot([result], "cpu").startswith(b"<?xml")
