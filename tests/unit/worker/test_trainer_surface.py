"""The trainer is not a hub (issue 45): the worker's components get what they use at
construction (progress, counters, the strategy, callbacks to checkpoint and log), so the
modules of ``elastic_ddp/worker/`` other than ``entry.py`` (which builds the trainer) and
``trainer.py`` itself reach few of the trainer's attributes. Fast: an AST walk."""
from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "elastic_ddp" / "worker"
EXEMPT = {"entry.py", "trainer.py", "__init__.py"}
#: The names a trainer goes by in the worker's modules: a parameter or local ``t`` /
#: ``trainer``, or one kept as ``self.t`` / ``self.trainer``.
TRAINER_NAMES = {"t", "trainer"}
LIMIT = 20


def _on_trainer(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in TRAINER_NAMES
    return (isinstance(node, ast.Attribute) and node.attr in TRAINER_NAMES
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def trainer_attributes(path: Path) -> set[str]:
    """The distinct attribute names ``path`` reads or writes on a trainer object (``t.x``,
    ``self.t.x``, ``getattr(trainer, "x", ...)``)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _on_trainer(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and _on_trainer(node.args[0])
              and isinstance(node.args[1], ast.Constant)):
            out.add(node.args[1].value)
    return out


def surface() -> dict[str, set[str]]:
    return {p.name: trainer_attributes(p) for p in sorted(WORKER.glob("*.py")) if p.name not in EXEMPT}


def test_the_worker_components_reach_few_trainer_attributes():
    """Counted per module and summed (a name two modules read counts twice)."""
    per_module = surface()
    total = sum(len(a) for a in per_module.values())
    detail = {m: sorted(a) for m, a in per_module.items() if a}
    assert total <= LIMIT, f"{total} trainer attributes (limit {LIMIT}): {detail}"


def test_the_measure_sees_a_trainer_attribute(tmp_path):
    """The walk finds what a component reading its trainer would write."""
    src = tmp_path / "component.py"
    src.write_text("class C:\n    def __init__(self, trainer):\n        self.t = trainer\n"
                   "    def f(self, t):\n        return self.t.progress.step + t.cfg.seed + trainer.rank\n"
                   "    def g(self):\n        return getattr(self.t, 'ledger', None)\n")
    assert trainer_attributes(src) == {"progress", "cfg", "rank", "ledger"}
