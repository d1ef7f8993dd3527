"""benchmarks/paper_table.py end to end on a tiny model (2 steps, RLOO K = 4 and PPO, one seed, one β of the
ablation): the table and the figures written, every run at equal samples by the completions it logged, a second
invocation with --resume reading the finished runs instead of training them again; and compare's checks of
--samples-per-step and algorithm:K."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from auto_research.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paper_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("paper_table", ROOT / "benchmarks" / "paper_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny architecture with room for the sums' prompts (45 characters) and a few new tokens."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("tiny-64")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _args(model: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--output-dir", str(output), "--seeds", "1", "--steps", "2", "--samples-per-step",
            "8", "--eval-every", "1", "--held-out", "4", "--only", "rloo:4,ppo-rlhf", "--betas", "0.1", *extra]


def test_the_paper_table_runs_at_equal_samples_writes_its_table_and_figures_and_resumes(paper_table, tiny_model,
                                                                                      tmp_path, capsys):
    paper_table.main(_args(tiny_model, tmp_path))
    err = capsys.readouterr().err
    assert "run 1/2: rloo, K = 4, seed 1" in err and "run 2/2: ppo-rlhf, K = 2, seed 1" in err
    # Equal samples, from the counts each run logged at each step: 8 completions a step, K = 4 from 2 prompts,
    # K = 2 from 4.
    for folder, prompts in ((tmp_path / "main" / "k4" / "rloo-sums-seed1", 2),
                            (tmp_path / "main" / "k2" / "ppo-rlhf-sums-seed1", 4),
                            (tmp_path / "beta-0.1" / "k4" / "rloo-sums-seed1", 2)):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [row["completions"] for row in rows] == [8, 8]
        assert json.loads((folder / "metrics.json").read_text())["training"]["prompts_per_step"] == prompts
        assert not (folder / "checkpoints").exists()  # dropped once the run finished; the rest is kept
        assert (folder / "config.yaml").is_file() and (folder / "curves.png").is_file()
    table = (tmp_path / "paper-table.md").read_text()
    assert "Equal samples, from the logged completion counts: every run the same, 16." in table
    assert "| rloo:4 | 4 | 2 | 8 | 16 | 1 |" in table and "| ppo-rlhf:2 | 2 | 4 | 8 | 16 | 1 |" in table
    assert "Command: `python benchmarks/paper_table.py --model " in table and "Machine: " in table
    assert "auto-research compare --dataset" in table and "--samples-per-step 8" in table
    # The ablation: the table's own β (0.02, real_model.py's recipe) and the one asked for, for both algorithms.
    assert table.count("| rloo:4 | 0.02 | 1 |") == table.count("| rloo:4 | 0.1 | 1 |") == 1
    assert table.count("| ppo-rlhf:2 | 0.1 | 1 |") == 1
    for figure in (tmp_path / "frontier.png", tmp_path / "main" / "classic-post-training-sums-seed1.png"):
        assert figure.read_bytes().startswith(b"\x89PNG")
    finished = (tmp_path / "main" / "k4" / "rloo-sums-seed1" / "metrics.json").read_text()

    # Again without --resume: the finished runs are refused, not overwritten.
    with pytest.raises(SystemExit) as stopped:
        paper_table.main(_args(tiny_model, tmp_path))
    assert stopped.value.code == 2 and "holds a finished run without its checkpoints" in capsys.readouterr().err
    # With --resume: read, not trained again.
    paper_table.main(_args(tiny_model, tmp_path, "--resume"))
    err = capsys.readouterr().err
    assert err.count("finished earlier, read from") == 4 and "resumed from" not in err
    assert (tmp_path / "main" / "k4" / "rloo-sums-seed1" / "metrics.json").read_text() == finished


def test_compare_refuses_samples_that_k_does_not_divide_and_a_malformed_k(tiny_model, sums_jsonl, tmp_path, capsys):
    common = ["compare", "--dataset", str(sums_jsonl), "--model", str(tiny_model), "--steps", "1", "--output-dir",
              str(tmp_path / "out")]
    assert cli([*common, "--algorithms", "rloo:4,rloo:2", "--samples-per-step", "6"]) == 2
    assert "--samples-per-step 6 is not a positive multiple of K = 4" in capsys.readouterr().err
    assert cli([*common, "--algorithms", "rloo:four"]) == 2
    assert "--algorithms rloo:four: K after the colon must be a whole number" in capsys.readouterr().err
    assert cli([*common, "--algorithms", "rloo", "--samples-per-step", "4", "--prompts-per-step", "2"]) == 2
    assert "leave --prompts-per-step out" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any run started


def test_algorithm_k_pairs_in_the_order_given():
    from auto_research.config.options import CompareOptions

    options = CompareOptions(algorithms="rloo:2,ppo-rlhf,rloo:4")
    assert options.generation_runs([2, 4]) == [("rloo", 2), ("ppo-rlhf", 2), ("ppo-rlhf", 4), ("rloo", 4)]


def test_compare_resume_continues_an_interrupted_run_from_its_checkpoint(tiny_model, tmp_path, capsys):
    import shutil

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(6)))
    command = ["compare", "--dataset", str(data), "--model", str(tiny_model), "--algorithms", "rloo:2", "--seeds", "1",
               "--samples-per-step", "4", "--steps", "2", "--max-new-tokens", "3", "--evaluation-examples", "4",
               "--eval-every", "0", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--offline", "--device",
               "cpu", "--output-dir", str(tmp_path / "out")]
    assert cli(command) == 0, capsys.readouterr().err
    run = tmp_path / "out" / "k2" / "rloo-sums-seed1"
    # As a run killed after its first checkpoint leaves it: no metrics.json, no step 2.
    (run / "metrics.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000002")
    capsys.readouterr()
    assert cli([*command, "--resume"]) == 0
    assert "run 1/1: rloo, K = 2, seed 1, resumed from its latest checkpoint" in capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["completions"]) for row in rows] == [(1, 4), (2, 4)]
    assert json.loads((run / "metrics.json").read_text())["training"]["steps"] == 2


def test_a_finished_run_of_fewer_steps_is_continued_not_read_as_done(tmp_path):
    """compare --resume with a longer --steps: the finished shorter run is not the run asked for (``_finished``
    compares the steps, which a resume may change)."""
    from auto_research.config.files import write_resolved_config
    from auto_research.config.generation import GenerationConfig
    from auto_research.recipes.compare import _finished

    short = GenerationConfig(dataset="x.jsonl", model="m", steps=2, output_dir=tmp_path, resume=True).filled()
    short.run_dir.mkdir(parents=True)
    write_resolved_config(short.run_dir / "config.yaml", short)
    (short.run_dir / "metrics.json").write_text("{}")
    assert _finished(short)
    assert not _finished(replace(short, steps=3))


def test_compare_refuses_k_and_trls_batch_it_would_run_at_another_k(tmp_path, capsys):
    for flags in (["--num-generations", "8"], ["--per-device-train-batch-size", "16"]):
        assert cli(["compare", "--dataset", "x.jsonl", "--model", "m", *flags, "--output-dir", str(tmp_path)]) == 2
        assert "compare runs each algorithm at its own K" in capsys.readouterr().err
