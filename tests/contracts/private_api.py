"""An import-linter contract type: no module outside the allowed ones (the compat seam)
uses a private API of a dependency.

import-linter's own contracts see an external package only as its top-level name
(``ray``, never ``ray._private``), so this contract reads the source: an ``import`` or
``from ... import`` of a dotted name with a component that starts with ``_`` (``ray._private``,
``ray.train.v2._internal``, ``from torch.nn.modules.batchnorm import _BatchNorm``), or an
attribute chain with such a component rooted at a name an import binds: a module
(``import ray; ray._private.worker``) or a name taken from one (``from
torch.distributed.algorithms.ddp_comm_hooks import default_hooks;
default_hooks._compress_hook``, ``from x import Cls; Cls._attr``), in any module of
``source_package`` outside ``allowed_modules``. Not caught: a private attribute of an
object the code made or was given (``manager._quorum_id``), since only names reachable
from an import are the dependency's.

Configured in pyproject.toml (``[tool.importlinter] contract_types``) and run by
``lint-imports`` (tests/project/test_import_contracts.py).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from importlinter import Contract, ContractCheck, fields, output


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
               for part in dotted.split("."))


def private_uses(path: Path, own: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private dependency API ``path`` imports or reaches."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    roots: dict[str, str] = {}  # a name an import binds -> the dependency's dotted name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in (own, "__future__"):
                    continue
                if a.asname:
                    roots[a.asname] = a.name
                else:
                    roots[a.name.split(".")[0]] = a.name.split(".")[0]
                if _private(a.name):
                    out.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in (own, "__future__"):
                continue
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if a.name != "*":
                    roots[a.asname or a.name] = full
                if _private(full):
                    out.append((node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in roots:
                dotted = ".".join([roots[cur.id], *reversed(parts)])
                if _private(dotted) and (node.lineno, dotted) not in out:
                    out.append((node.lineno, dotted))
    # An attribute chain is also seen by its prefixes: keep the longest per line.
    return sorted({(ln, d) for ln, d in out
                   if not any(ln == l2 and d2 != d and d2.startswith(d + ".") for l2, d2 in out)})


class PrivateApiContract(Contract):
    """Options: ``source_package`` (a package of this project), ``allowed_modules``
    (modules or packages that may use private dependency APIs)."""

    source_package = fields.StringField()
    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        spec = importlib.util.find_spec(str(self.source_package))
        root = Path(spec.origin).parent
        own = str(self.source_package).split(".")[0]
        allowed = [str(m) for m in self.allowed_modules]
        broken = []
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).with_suffix("")
            module = ".".join(p for p in rel.parts if p != "__init__")
            if any(module == a or module.startswith(a + ".") for a in allowed):
                continue
            for line, name in private_uses(path, own):
                broken.append({"module": module, "line": line, "name": name})
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for b in check.metadata["broken"]:
            output.print_error(f"{b['module']}:{b['line']} uses {b['name']}, a private API of a "
                               "dependency: move it into elastic_ddp/compat/ with a version guard")
            output.new_line()
