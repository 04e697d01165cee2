"""The demo (the README's main job for now) decodes identically in both loops."""

from __future__ import annotations

import pytest

from tandem.futuremap.demo import DemoRequest, ToyModel, main, run_loop
from tandem.futuremap.runtime import HostStream


def test_normal_and_overlap_loops_produce_identical_tokens() -> None:
    model = ToyModel(work=2, dim=32)

    def fresh() -> list[DemoRequest]:
        return [DemoRequest(row=i + 1, prompt_token=3 * i, max_new_tokens=5 + i) for i in range(5)]

    with HostStream(max_delay_s=0.001, seed=2) as stream:
        normal, overlap = fresh(), fresh()
        run_loop(normal, model, stream, overlap=False)
        run_loop(overlap, model, stream, overlap=True)
    assert [len(r.output) for r in overlap] == [5, 6, 7, 8, 9]
    assert [r.output for r in normal] == [r.output for r in overlap]


def test_main_prints_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--requests", "3", "--max-new-tokens", "4", "--work", "1"]) == 0
    assert "identical tokens: True" in capsys.readouterr().out


def test_main_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--requests", "0"])
