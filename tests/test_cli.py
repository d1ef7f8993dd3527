"""The command line end to end, and every bad input: one line, exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from auto_research.cli import ALGORITHMS, DATASETS, main
from auto_research.algorithms.registry import REGISTRY
from auto_research.config.fields import DATASETS as CONFIG_DATASETS
from conftest import run_cli

SEED_COMMAND = ["post-train", "--algorithm", "rloo", "--dataset", "gsm8k-candidate", "--maximum-examples", "512",
                "--steps", "300", "--group-size", "4", "--seed", "42", "--offline"]


def test_cli_lists_match_the_registry():
    # The CLI keeps its own lists so that --help never imports NumPy; they must not drift.
    assert set(ALGORITHMS) == set(REGISTRY)
    assert DATASETS == CONFIG_DATASETS


def test_seed_command_end_to_end(shared_data, tmp_path):
    result = run_cli(*SEED_COMMAND, cwd=tmp_path, env={"AUTO_RESEARCH_DATA": str(shared_data)})
    assert result.returncode == 0, result.stderr
    assert "accuracy              0.1641      0.8281" in result.stdout
    assert "KL(reference)         0.0000      0.5707" in result.stdout
    run_dir = tmp_path / "runs" / "post-training" / "rloo-gsm8k-candidate-seed42"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["algorithm"] == "rloo" and metrics["dataset"] == "gsm8k-candidate"
    assert metrics["final"]["mean_reward"] == pytest.approx(0.85085787, abs=5e-9)
    assert set(metrics["baseline"]) == {"accuracy", "mean_reward", "entropy", "kl_from_reference"}
    for key in ("steps", "learning_rate", "group_size", "train_examples", "validation_examples", "data_source"):
        assert key in metrics["training"]
    assert str(shared_data.resolve()) in metrics["training"]["data_source"]
    report = (run_dir / "report.md").read_text()
    assert "| accuracy | 0.1641 | 0.8281 |" in report
    # Nothing but the outputs: no temporary files left beside them.
    assert sorted(path.name for path in run_dir.iterdir()) == ["metrics.json", "report.md"]


def test_data_dir_defaults_to_data_in_the_working_directory(shared_data, tmp_path):
    (tmp_path / "data").symlink_to(shared_data, target_is_directory=True)
    result = run_cli(*SEED_COMMAND, "--steps", "30", cwd=tmp_path, env={"AUTO_RESEARCH_DATA": ""})
    assert result.returncode == 0, result.stderr


def test_candidate_run_never_imports_torch(shared_data, tmp_path):
    code = (
        "import sys\n"
        "from auto_research.cli import main\n"
        f"assert main({SEED_COMMAND + ['--steps', '30', '--dataset-dir', str(shared_data), '--output-dir', str(tmp_path)]!r}) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'matplotlib'))\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_help_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from auto_research.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'transformers', 'tqdm'))\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "post-train" in result.stdout and "compare" in result.stdout


def test_several_seeds_write_a_run_each_and_a_summary(shared_data, tmp_path, capsys):
    code = main(["post-train", "--dataset", "gsm8k-candidate", "--dataset-dir", str(shared_data), "--offline",
                 "--steps", "60", "--seeds", "42,43,44", "--output-dir", str(tmp_path)])
    assert code == 0
    finals = []
    for seed in (42, 43, 44):
        metrics = json.loads((tmp_path / f"rloo-gsm8k-candidate-seed{seed}" / "metrics.json").read_text())
        assert metrics["seed"] == seed
        finals.append(metrics["final"]["accuracy"])
    summary = json.loads((tmp_path / "rloo-gsm8k-candidate-seeds42-43-44-summary.json").read_text())
    mean = sum(finals) / 3
    std = (sum((value - mean) ** 2 for value in finals) / 2) ** 0.5  # sample std: n − 1
    assert summary["final"]["accuracy"]["mean"] == pytest.approx(mean)
    assert summary["final"]["accuracy"]["std"] == pytest.approx(std)
    assert summary["seeds"] == [42, 43, 44]
    assert "±" in capsys.readouterr().out


def test_compare_writes_summary_table_and_plot(shared_data, tmp_path):
    code = main(["compare", "--dataset", "gsm8k-candidate", "--algorithms", "rloo,ppo-rlhf,grpo,remax,reinforce,vanilla-pg,raft",
                 "--seeds", "42", "--maximum-examples", "512", "--steps", "300", "--group-size", "4",
                 "--dataset-dir", str(shared_data), "--offline", "--output-dir", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "classic-post-training-gsm8k-seed42.json").read_text())
    assert list(summary["algorithms"]) == ["rloo", "ppo-rlhf", "grpo", "remax", "reinforce", "vanilla-pg", "raft"]
    assert summary["algorithms"]["rloo"]["final"]["accuracy"]["mean"] == 0.828125
    assert summary["algorithms"]["raft"]["final"]["kl_from_reference"]["mean"] == pytest.approx(0.87885476, abs=5e-9)
    table = (tmp_path / "classic-post-training-gsm8k-seed42.md").read_text()
    assert "| rloo | 0.8281 | 0.8509 |" in table
    png = (tmp_path / "classic-post-training-gsm8k-seed42.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert (tmp_path / "grpo-gsm8k-candidate-seed42" / "metrics.json").is_file()


def test_compare_names_several_seeds(tmp_path):
    assert main(["compare", "--algorithms", "rloo,grpo", "--seeds", "1,2", "--steps", "20",
                 "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "classic-post-training-arithmetic-seeds1-2.json").read_text())
    assert set(summary["algorithms"]["grpo"]["runs"]) == {"1", "2"}
    assert summary["algorithms"]["grpo"]["final"]["accuracy"]["std"] is not None


BAD_INPUTS = [
    (["--algorithm", "dpo"], "unknown algorithm 'dpo'; choose one of: rloo, ppo-rlhf, grpo, remax"),
    (["--dataset", "mnist"], "unknown dataset 'mnist'; choose one of: arithmetic-smoke, gsm8k-candidate"),
    (["--group-size", "1"], "leave-one-out is undefined for K = 1"),
    (["--algorithm", "grpo", "--group-size", "1"], "too small for grpo"),
    (["--algorithm", "vanilla-pg", "--group-size", "1"], "--group-size 1 is outside 2..6"),
    (["--group-size", "7"], "--group-size 7 is outside 2..6"),
    (["--maximum-examples", "7"], "--maximum-examples 7 is below the minimum of 8"),
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--steps", "-3"], "--steps must be a positive integer, got -3"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--learning-rate", "0"], "--learning-rate must be a finite number > 0, got 0.0"),
    (["--learning-rate", "-0.1"], "--learning-rate must be a finite number > 0, got -0.1"),
    (["--learning-rate", "inf"], "--learning-rate must be a finite number > 0, got inf"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number > 0, got nan"),
    (["--beta", "-1"], "--beta must be a finite number >= 0"),
    (["--seeds", "42,forty"], "--seeds takes comma-separated integers such as 42,43,44; got 'forty'"),
    (["--seeds", "42,42"], "--seeds lists a seed twice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # Digits beyond 0-9 ("²".isdigit() is true, int("²") a ValueError): one line, not a traceback.
    (["--dataset", "arithmetic-generate", "--rollout-mode", "server", "--rollout-server", "h:²"],
     "--rollout-server 'h:²': expected HOST:PORT"),
    (["--dataset", "arithmetic-generate", "--rollout-mode", "process", "--rollout-cores", "²"],
     "--rollout-cores '²': expected CPU numbers or ranges"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS, ids=[" ".join(flags) for flags, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, flags, message):
    output = tmp_path / "out"
    code = main(["post-train", "--output-dir", str(output), *flags])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("auto-research: error: ")
    assert message in lines[0]
    assert not output.exists()


def test_bad_input_in_compare(tmp_path, capsys):
    assert main(["compare", "--algorithms", "rloo,ppo", "--output-dir", str(tmp_path / "out")]) == 2
    assert "unknown algorithm 'ppo'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unwritable_output_directory(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["post-train", "--output-dir", str(blocker / "runs")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("auto-research: error: cannot write to output directory") and error.count("\n") == 1


def test_missing_data_offline_names_the_path_and_the_remedy(tmp_path, capsys):
    code = main(["post-train", "--dataset", "gsm8k-candidate", "--offline", "--dataset-dir", str(tmp_path / "nowhere"),
                 "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert str(tmp_path / "nowhere" / "gsm8k" / "train.jsonl") in error
    assert "auto-research data gsm8k" in error
    assert not (tmp_path / "out").exists()


def test_malformed_data_line_exits_2_with_file_and_line(tmp_path, capsys):
    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    rows = ['{"question": "q", "answer": "#### %d"}' % i for i in range(20)]
    rows[11] = '{"question": "q", "answer": '
    (folder / "train.jsonl").write_text("\n".join(rows) + "\n")
    (folder / "test.jsonl").write_text("\n".join(rows[:5]) + "\n")
    code = main(["post-train", "--dataset", "gsm8k-candidate", "--offline", "--dataset-dir", str(tmp_path / "data"),
                 "--maximum-examples", "16", "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 2
    assert f"{folder / 'train.jsonl'}:12: not valid JSON" in error
    assert not (tmp_path / "out").exists()


def test_process_exit_status_is_2_without_traceback(tmp_path):
    result = run_cli("post-train", "--steps", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr == "auto-research: error: --steps must be a positive integer, got 0\n"


def test_generation_flags_are_generated_from_the_config_fields(tmp_path):
    from auto_research.cli import build_parser
    from auto_research.cli.flags import flag_names, given
    from auto_research.config.generation import SECTIONS, GenerationConfig
    from auto_research.config.fields import SECTIONS as HELP_GROUPS
    from auto_research.config.files import read_config_file, write_config_file

    parser = build_parser()
    sectioned = {item.name: item for item in GenerationConfig.flat_fields() if item.metadata.get("section")}
    assert set(flag_names(GenerationConfig)) == set(sectioned)
    # Every setting in a section, each section a group of --help.
    assert {GenerationConfig.section_of(name) for name in sectioned} == set(SECTIONS) <= set(HELP_GROUPS)
    # Names, defaults and help are written once, in the dataclass.
    text = parser._subparsers._group_actions[0].choices["post-train"].format_help()
    assert "weight of the value loss (the critic has its own AdamW) (default: 0.1)" in " ".join(text.split())
    args = parser.parse_args(["post-train", "--dataset", "rows.jsonl", "--ppo-epochs", "3", "--no-whiten-advantages",
                              "--reward-weights", "1,0.5", "--reward", "match", "--reward", "format", "--top-k", "5"])
    config = GenerationConfig(**given(args, GenerationConfig))
    assert (config.updates_per_batch, config.whiten_advantages, config.reward_weights, config.reward, config.top_k) == (
        3, False, [1.0, 0.5], ["match", "format"], 5)
    # compare and rlhf hand each run its settings as a JSON file, which reads back as the same settings.
    path = write_config_file(tmp_path / "run.json", config)
    assert GenerationConfig(**read_config_file(path, [GenerationConfig])) == config
    assert read_config_file(path, [GenerationConfig])["reward"] == ["match", "format"]
    # Unset flags keep the dataclass's defaults (or presets, filled later).
    assert config.gae_lambda == GenerationConfig().critic.gae_lambda == 1.0 and config.temperature is None
