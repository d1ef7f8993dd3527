"""Experiment trackers (``--report-to tensorboard,wandb,trackio,mlflow``): the scalars of metrics.jsonl, the
run's resolved config and the completion tables, sent to each tracker named. Each is an optional extra,
imported only by a run that names it; a missing one is refused before any work, with the line to install it.
Where each writes, and how a resumed run continues its tracker runs: docs/generation-level.md.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import os
import time
import uuid
from pathlib import Path

from auto_research.errors import UserError, one_line
from auto_research.files import atomic_write_json
from auto_research.report.tables import markdown_table

# name → (module to find, PyPI package of the extra)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "trackio": ("trackio", "trackio"), "mlflow": ("mlflow", "mlflow-skinny")}
IDS = "trackers.json"


def parse_report_to(value: str) -> tuple[str, ...]:
    """``--report-to``'s comma-separated names, checked: unknown names and missing extras are one line each."""
    names = [name.strip() for name in str(value).split(",") if name.strip()]
    if names in ([], ["none"]):
        return ()
    for name in names:
        if name not in TRACKERS and name != "none":
            nearest = difflib.get_close_matches(name, [*TRACKERS, "none"], n=1)
            hint = f" (did you mean {nearest[0]}?)" if nearest else ""
            raise UserError(f"--report-to: unknown tracker {name!r}{hint}; choose none or a comma-separated list "
                            f"of {', '.join(TRACKERS)}")
    if "none" in names:
        raise UserError("--report-to: none cannot be listed with a tracker")
    for name in names:
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"--report-to {name} needs the {package} package: pip install 'auto-research[{name}]' "
                            f"(or pip install {package})")
    if "mlflow" in names:
        _check_mlflow_store()
    return tuple(dict.fromkeys(names))


def _check_mlflow_store() -> None:
    """MLflow resolves its store when a client is made, without writing: a store it will refuse (MLflow 3
    refuses a bare ./mlruns file store) is refused here, before the run starts."""
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient()
    except Exception as error:  # noqa: BLE001 — MLflow raises its own exception types for every store problem
        first = str(error).strip().split(". ")[0].split("\n")[0]
        raise UserError(f"--report-to mlflow: MLflow cannot open its tracking store ({first}); set "
                        "MLFLOW_TRACKING_URI to a server (http://host:5000), a database (sqlite:///mlflow.db, with the "
                        "full mlflow package), or a file store with MLFLOW_ALLOW_FILE_STORE=true") from None


class TensorBoard:
    def __init__(self, run_dir: Path, name: str, project: str, settings: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(settings, indent=1, default=str) + "\n```", 0)

    def scalars(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def table(self, key: str, rows: list[dict], step: int) -> None:
        self.writer.add_text(key, markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


def _columns(rows: list[dict]) -> tuple[list[str], list[list]]:
    columns = list(rows[0])
    return columns, [[row.get(column) for column in columns] for row in rows]


class _RunWithLog:
    """wandb's and trackio's shape: a run with ``log(values, step=)`` and ``finish()``, and a ``Table`` type."""

    run = table_type = None

    def scalars(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def table(self, key: str, rows: list[dict], step: int) -> None:
        columns, data = _columns(rows)
        self.run.log({key: self.table_type(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandB(_RunWithLog):
    def __init__(self, run_dir: Path, name: str, project: str, settings: dict, ids: dict):
        import wandb

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.table_type = wandb.Table
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=name, id=ids["id"],
                              resume="allow", dir=str(run_dir), config=settings, reinit="create_new")


class Trackio(_RunWithLog):
    def __init__(self, run_dir: Path, name: str, project: str, settings: dict, ids: dict):
        import trackio

        self.table_type = trackio.Table
        self.run = trackio.init(project=project, name=f"{name}-{ids['id']}", config=settings, resume="allow",
                                auto_log_cpu=False, auto_log_gpu=False)


class MLflow:
    def __init__(self, run_dir: Path, name: str, project: str, settings: dict, ids: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient()
        experiment = client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(project)
        if ids.get("mlflow") is None:
            ids["mlflow"] = client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(key, json.dumps(value, default=str)[:6000]) for key, value in settings.items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                client.log_batch(ids["mlflow"], params=params[start:start + 100])
        else:
            client.update_run(ids["mlflow"], status="RUNNING")
        self.run_id = ids["mlflow"]

    def scalars(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in values.items()])

    def table(self, key: str, rows: list[dict], step: int) -> None:
        columns, data = _columns(rows)
        self.client.log_table(self.run_id, data={column: [row[i] for row in data] for i, column in enumerate(columns)},
                              artifact_file=f"completions/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


OPENERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}


class Trackers:
    """The trackers of one run (rank 0): opened at the run folder's first write, each sent the same events.
    A tracker that fails mid-run is reported once and dropped; training goes on (metrics.jsonl has it all)."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, project: str, settings: dict, resumed: bool,
                 warn=print):
        self.warn, self.open = warn, {}
        path = Path(run_dir) / IDS
        ids = json.loads(path.read_text()) if resumed and path.is_file() else {}
        ids.setdefault("id", uuid.uuid4().hex[:8])
        for name in names:
            try:
                self.open[name] = OPENERS[name](Path(run_dir), Path(run_dir).name, project, settings, ids)
            except Exception as error:  # noqa: BLE001 — any tracker's failure to start is the same one line
                self.close()
                raise UserError(f"--report-to {name}: the tracker did not start ({one_line(error)})") from None
        atomic_write_json(path, ids)

    def _each(self, method: str, *args) -> None:
        for name, tracker in list(self.open.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # noqa: BLE001
                self.warn(f"warning: --report-to {name} failed ({one_line(error)}); "
                          "it gets nothing more this run (metrics.jsonl has every figure)")
                self.open.pop(name)

    def scalars(self, values: dict, step: int) -> None:
        if values:
            self._each("scalars", values, step)

    def table(self, key: str, rows: list[dict], step: int) -> None:
        if rows:
            self._each("table", key, rows, step)

    def close(self) -> None:
        for tracker in self.open.values():
            with contextlib.suppress(Exception):  # closing is best effort; what was logged is kept
                tracker.close()
        self.open = {}
