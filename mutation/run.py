"""Mutation testing of the core with cosmic-ray: `python -m mutation.run [MODULE ...]` (`make mutation`).

For each target of mutation/targets.toml (or the modules named), in a copy of the working tree (cosmic-ray edits
the module it mutates in place): every mutant cosmic-ray's operators make of the module, each tested by running
the target's test files as a fresh interpreter would (a fork of the warm runner, mutation/warm.py, which
imported the third-party libraries once; `--fresh`: a new interpreter). A mutant is *killed* when the tests fail, *timed out* when they
run past the limit (three times the unmutated run, at least 60 s; a mutant that loops counts as caught), and
*survived* when they pass. Mutants inside annotations are not run: with `from __future__ import annotations` no
annotation is evaluated, so they are equivalent by construction. As many mutants run at once as there are cores,
each in its own copy (cosmic-ray's http workers). The counts and the surviving mutants go to mutation/results/<module>.json and MUTATION.md is written again
from every result there, so modules can be run one at a time. Not part of `make test`: a module takes minutes
to an hour on 2 cores.

A target may name `functions` (qualified names, "Class.method" for a method): then only the mutants inside
those functions run (the rest of the module is glue the target's tests do not aim at); the report names them.

Each result records the sha256 of the module it mutated. `--check` (run by `make test` in tests/test_mutation_report.py)
fails when a saved result is older than its module (the source changed since: its counts and its survivors'
line numbers describe another file), when a result was made with other tests, marker selection or functions than
its target names now, or when MUTATION.md is not what the saved results give.

A survivor's explanation (targets.toml's [explained."<module>"]) is keyed by its id, which moves with the source's
line numbers. When a module is run again, each new survivor takes the explanation of the saved run's survivor with
the same operator and diff (ids named in the texts are renamed with it); the survivors left without one are printed,
and `--check` fails while any survivor is unexplained.

`--survivors` runs again only the mutants that survived a module's saved run (after tests were added) and
updates its counts: the mutants the saved run caught stay caught, since tests were only added. It refuses a
module whose source changed since that run (its sha256 is in the result): then its mutants are not the same.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ROOT / "mutation" / "targets.toml"
RESULTS = ROOT / "mutation" / "results"
REPORT = ROOT / "MUTATION.md"
# Outcomes that count as the tests catching a mutant.
CAUGHT = ("killed", "timed out")
# Ignored paths the tests read (the embedded models), linked into the copy.
LINKED = ["examples/models"]


def load_targets() -> tuple[list[dict], dict[str, dict[str, str]]]:
    spec = tomllib.loads(TARGETS.read_text())
    return spec["target"], spec.get("explained", {})


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and new files, nothing ignored), plus the linked folders."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for name in LINKED:
        if (ROOT / name).exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(ROOT / name, dest / name)


def test_command(tests: list[str], select: str | None = None, warm: Path | None = None) -> list[str]:
    """pytest on the target's test files; `select` a marker expression (a target's "not slow" leaves out its
    files' Ray and end-to-end tests, which would cost minutes per mutant). With `warm` (the socket of a
    mutation/warm.py server), the run is a fork of that warm process instead of a fresh interpreter."""
    marker = ["-m", select] if select else []
    args = ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *marker, *tests]
    if warm is not None:
        return [sys.executable, "mutation/warm.py", "run", str(warm), "--", *args]
    return [sys.executable, "-m", "pytest", *args]


@contextlib.contextmanager
def warm_server(folder: Path, env: dict[str, str]):
    """A mutation/warm.py server (its libraries imported once) for the target's test runs; yields its socket."""
    sock = folder / "warm.sock"
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # nothing of the project before the fork
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "mutation" / "warm.py"), "serve", str(sock)],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        for line in server.stdout:
            if line.strip() == "warm runner ready":
                break
        else:
            raise SystemExit(f"the warm runner did not start (exit code {server.wait(60)})")
        yield sock
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every annotation: with `from __future__ import annotations` they are never
    evaluated, so mutants there are equivalent by construction and are not run."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        found = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]
    return spans


def function_spans(source: str, names: list[str]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of the named functions ("f", or "Class.method"), decorators included; an error
    naming any that the module does not define."""
    found: dict[str, ast.AST] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found[name] = child
                visit(child, name + ".")

    visit(ast.parse(source), "")
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"functions not in the module: {missing}; it defines {sorted(found)}")
    spans = []
    for name in names:
        node = found[name]
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        spans.append(((first, 0), (node.end_lineno, node.end_col_offset)))
    return spans


def skip_pending(session: Path, skip, reason: str) -> int:
    """Marks every mutant not yet run for which `skip(item)` holds skipped with `reason` (cosmic-ray then runs
    none of them); returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    skipped = 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            if skip(item):
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=reason))
                skipped += 1
    return skipped


def starts_in(item, spans: list) -> bool:
    (mutation,) = item.mutations
    return any(lo <= tuple(mutation.start_pos) < hi for lo, hi in spans)


def skip_outside(session: Path, spans: list) -> int:
    """Marks the mutants outside `spans` skipped (the target names only some functions); returns how many."""
    return skip_pending(session, lambda item: not starts_in(item, spans), "outside")


def skip_annotations(session: Path, source: str) -> int:
    """Marks the mutants inside annotations skipped (cosmic-ray's filters do the same); returns how many."""
    if "from __future__ import annotations" not in source:
        return 0
    spans = annotation_spans(source)
    return skip_pending(session, lambda item: starts_in(item, spans), "annotation")


def source_sha256(module: str) -> str:
    return hashlib.sha256((ROOT / module).read_bytes()).hexdigest()


def result_path(module: str) -> Path:
    return RESULTS / (module.replace("/", ".").removesuffix(".py") + ".json")


def mutant_id(item) -> str:
    (mutation,) = item.mutations
    return f"{mutation.start_pos[0]}:{mutation.operator_name}:{mutation.occurrence}"


def skip_all_but(session: Path, ids: set[str]) -> int:
    """Marks every mutant not in `ids` skipped (caught by the saved run); returns how many are left to run."""
    skip_pending(session, lambda item: mutant_id(item) not in ids, "caught before")
    return len(pending_ids(session))


def pending_ids(session: Path) -> list[str]:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return [mutant_id(item) for item in db.pending_work_items]


def saved_survivors(module: str) -> dict:
    path = result_path(module)
    if not path.is_file():
        raise SystemExit(f"{module}: --survivors needs a saved run ({path.relative_to(ROOT)} is missing)")
    saved = json.loads(path.read_text())
    if saved.get("source_sha256") != source_sha256(module):
        raise SystemExit(f"{module}: the source changed since the saved run; run the module whole")
    return saved


def run_target(target: dict, workers: int, survivors_only: bool = False, fresh: bool = False) -> dict:
    """Mutate one module, `workers` mutants at a time, each worker in a fresh copy of the tree (cosmic-ray
    mutates the file in place); returns the results. With `survivors_only`, only the saved run's survivors run
    and the saved counts are updated. Each test run forks the warm runner (mutation/warm.py), or with `fresh`
    starts a fresh interpreter."""
    module, tests, select = target["module"], target["tests"], target.get("select")
    saved = saved_survivors(module) if survivors_only else None
    with tempfile.TemporaryDirectory(prefix="roll-mutation-") as tmp, contextlib.ExitStack() as stack:
        warm = None if fresh else stack.enter_context(warm_server(Path(tmp), dict(os.environ)))
        copies = [Path(tmp) / f"copy{i}" for i in range(workers)]
        for copy in copies:
            copy.mkdir()
            copy_tree(copy)
        work = copies[0]
        env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.monotonic()
        baseline = subprocess.run(test_command(tests, select, warm), cwd=work, env=env, capture_output=True, text=True)
        if baseline.returncode != 0:
            raise SystemExit(f"{module}: its tests fail without any mutation:\n{baseline.stdout[-3000:]}")
        limit = max(60.0, 3 * (time.monotonic() - started))
        ports = [free_port() for _ in copies]
        config = Path(tmp) / "cosmic-ray.toml"
        config.write_text(
            "[cosmic-ray]\n"
            f'module-path = "{module}"\n'
            f"timeout = {limit:.0f}\n"
            "excluded-modules = []\n"
            f"test-command = {json.dumps(shlex.join(test_command(tests, select, warm)))}\n"
            '[cosmic-ray.distributor]\nname = "http"\n'
            "[cosmic-ray.distributor.http]\n"
            f"worker-urls = {json.dumps([f'http://127.0.0.1:{p}' for p in ports])}\n"
        )
        session = Path(tmp) / "session.sqlite"
        cosmic = [sys.executable, "-m", "cosmic_ray.cli"]
        subprocess.run([*cosmic, "init", str(config), str(session)], cwd=work, env=env, check=True)
        source = (ROOT / module).read_text()
        skipped = skip_annotations(session, source)
        functions = target.get("functions", [])
        outside = skip_outside(session, function_spans(source, functions)) if functions else 0
        total = count_mutants(session) - outside
        if saved is not None:
            ids = {m["id"] for m in saved["survivors"]}
            left = skip_all_but(session, ids)
            if left != len(ids):
                raise SystemExit(f"{module}: {len(ids) - left} saved survivors are not among the mutants now")
            print(f"{module}: of {total - skipped} mutants, the saved run's {left} survivors only", flush=True)
        scope = f" in {', '.join(functions)}" if functions else ""
        print(
            f"{module}: {total - skipped} mutants{scope} ({skipped} in annotations not run), tests {' '.join(tests)}, "
            f"limit {limit:.0f} s each, {workers} at a time",
            flush=True,
        )
        servers = [
            subprocess.Popen(
                [*cosmic, "http-worker", "--port", str(port)],
                cwd=copy, env={**env, "PYTHONPATH": str(copy)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for copy, port in zip(copies, ports, strict=True)
        ]
        try:
            for port in ports:
                wait_for_port(port)
            subprocess.run([*cosmic, "exec", str(config), str(session)], cwd=work, env=env, check=True)
        finally:
            for server in servers:
                server.terminate()
                server.wait(30)
        mutants = read_session(session)
        for copy in copies:
            if (copy / module).read_text() != (ROOT / module).read_text():
                raise SystemExit(f"{module}: a copy was left mutated; results not trusted")
    counts = summarize(mutants)
    run_s = round(time.monotonic() - started)
    if saved is not None:  # the rerun survivors' outcomes replace theirs in the saved counts
        for m in saved["survivors"]:
            saved["counts"][m["outcome"] if m["outcome"] in counts else "other"] -= 1
        counts = {key: saved["counts"][key] + n for key, n in counts.items()}
        run_s += saved["run_s"]
    return {
        "module": module,
        "source_sha256": source_sha256(module),
        "tests": tests,
        "functions": target.get("functions", []),
        "select": select,
        "goal": target["goal"],
        "limit_s": round(limit),
        "runner": "fresh" if fresh else "warm",
        "run_s": run_s,
        "counts": counts,
        "survivors": [m for m in mutants if m["outcome"] not in CAUGHT],
    }


MUTANT_ID = re.compile(r"\b\d+:core/\w+:\d+\b")


def carried_explanations(previous: dict | None, result: dict, notes: dict[str, str]) -> tuple[dict[str, str], list]:
    """The explanations for `result`'s survivors: each takes that of the previous run's survivor with the same
    operator and diff (an id alone may name another mutant once lines moved), ids in the text renamed; with no
    previous run, the notes by id. Returns them and the survivors left without one."""
    key = lambda m: (m["operator"], m["diff"])  # noqa: E731
    new_ids: dict[tuple, list[str]] = {}
    for m in result["survivors"]:
        new_ids.setdefault(key(m), []).append(m["id"])
    old = previous["survivors"] if previous else []
    rename = {}
    for m in old:
        ids = new_ids.get(key(m), [])
        if ids:
            rename[m["id"]] = m["id"] if m["id"] in ids else ids[0]
    by_key = {key(m): notes[m["id"]] for m in old if m["id"] in notes}
    out, missing = {}, []
    for m in result["survivors"]:
        why = by_key.get(key(m)) if previous else notes.get(m["id"])
        if why is None:
            missing.append(m)
        else:
            out[m["id"]] = MUTANT_ID.sub(lambda x: rename.get(x.group(0), x.group(0)), why)
    return out, missing


def with_explanations(text: str, module: str, notes: dict[str, str]) -> str:
    """targets.toml's text with the [explained."<module>"] table replaced by `notes` (appended when absent)."""
    header = f'[explained."{module}"]'
    table = "\n".join([header] + [f"{json.dumps(i)} = {json.dumps(w, ensure_ascii=False)}" for i, w in notes.items()])
    start = text.find(header + "\n")
    if start < 0:
        if "\n[explained]\n" not in "\n" + text:
            text = text.rstrip("\n") + "\n\n[explained]\n"
        return text.rstrip("\n") + "\n\n" + table + "\n"
    end = text.find("\n[", start + len(header))
    rest = text[end:].lstrip("\n") if end >= 0 else ""
    return text[:start] + table + "\n" + ("\n" + rest if rest else "")


def wait_for_port(port: int, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"cosmic-ray's http worker on port {port} did not start") from None
            time.sleep(0.2)


def count_mutants(session: Path) -> int:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return db.num_work_items


def read_session(session: Path) -> list[dict]:
    from cosmic_ray.work_db import WorkDB, use_db

    out = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            (mutation,) = item.mutations
            outcome = str(result.test_outcome.value) if result.test_outcome else str(result.worker_outcome.value)
            if outcome == "killed" and (result.output or "").strip() == "timeout":
                outcome = "timed out"
            if outcome == "skipped":
                continue  # in an annotation (skip_annotations)
            out.append(
                {
                    "id": f"{mutation.start_pos[0]}:{mutation.operator_name}:{mutation.occurrence}",
                    "line": mutation.start_pos[0],
                    "operator": mutation.operator_name,
                    "outcome": outcome,
                    "diff": "\n".join(
                        line for line in (result.diff or "").splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")
                    ),
                }
            )
    return sorted(out, key=lambda m: (m["line"], m["id"]))


def summarize(mutants: list[dict]) -> dict[str, int]:
    counts = {"killed": 0, "timed out": 0, "survived": 0, "other": 0}
    for m in mutants:
        counts[m["outcome"] if m["outcome"] in counts else "other"] += 1
    return counts


def saved_results() -> dict[str, dict]:
    results = {}
    for path in RESULTS.glob("*.json"):
        data = json.loads(path.read_text())
        results[data["module"]] = data
    return results


def write_report(explained: dict[str, dict[str, str]]) -> None:
    REPORT.write_text(render_report(explained))


def render_report(explained: dict[str, dict[str, str]]) -> str:
    targets, _ = load_targets()
    order = [t["module"] for t in targets]
    goals = {t["module"]: t["goal"] for t in targets}
    results = saved_results()
    lines = [
        "# Mutation testing",
        "",
        "cosmic-ray's mutants of the core modules, each tested by that module's fast tests (`make mutation`;",
        "mutation/run.py explains the method, mutation/targets.toml lists the targets, their tests and goals, and why",
        "each surviving mutant survives). *Caught* counts killed and timed-out mutants. Regenerate one module with",
        "`make mutation MODULES=roll_core/algorithms/kl.py`.",
        "",
        "| module | mutants | killed | timed out | survived | other | caught | goal | run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    details = []
    for module in order:
        if module not in results:
            lines.append(f"| {module} | not run yet | | | | | | | |")
            continue
        r = results[module]
        c = r["counts"]
        name = f"{module} ({', '.join(r['functions'])})" if r.get("functions") else module
        n = sum(c.values())
        goal = goals[module]
        if n:
            caught = (c["killed"] + c["timed out"]) / n
            share = f"{caught:.1%}" + ("" if caught >= goal else " (below)")
        else:  # no operator applies to the code it names: nothing to catch, and no share to claim
            share = "no mutant"
        lines.append(
            f"| {name} | {n} | {c['killed']} | {c['timed out']} | {c['survived']} | {c['other']} | "
            f"{share} | {goal:.0%} | {r['run_s'] / 60:.0f} min |"
        )
        survivors = r["survivors"]
        if survivors:
            selected = f" (-m \"{r['select']}\")" if r.get("select") else ""
            details += ["", f"## {name}", "", f"Tests: {' '.join(r['tests'])}{selected}", ""]
            notes = explained.get(module, {})
            for m in survivors:
                why = notes.get(m["id"], "unexplained")
                diff = m["diff"].replace("\n", " / ") or "(no diff)"
                details.append(f"- `{m['id']}` ({m['outcome']}): `{diff}` — {why}")
    return "\n".join(lines + details) + "\n"


def check() -> list[str]:
    """What makes MUTATION.md out of date (empty when nothing does): see the module docstring."""
    targets, explained = load_targets()
    results = saved_results()
    problems = []
    for target in targets:
        module = target["module"]
        r = results.get(module)
        if r is None:
            continue  # "not run yet" in the report
        if r.get("source_sha256") != source_sha256(module):
            problems.append(f"{module}: changed since its mutation run (`make mutation MODULES={module}`)")
        same_run = [r["tests"], r.get("functions", []), r.get("select")]
        if same_run != [target["tests"], target.get("functions", []), target.get("select")]:
            problems.append(f"{module}: its saved run used other tests, marker selection or functions than targets.toml")
        unexplained = [m["id"] for m in r["survivors"] if m["id"] not in explained.get(module, {})]
        if unexplained:
            problems.append(f"{module}: survivors without an explanation in targets.toml: {', '.join(unexplained)}")
    for module in sorted(set(results) - {t["module"] for t in targets}):
        problems.append(f"{module}: a saved result for a module that is not a target")
    if not REPORT.is_file() or REPORT.read_text() != render_report(explained):
        problems.append("MUTATION.md is not what the saved results give (`python -m mutation.run --report-only`)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: every target)")
    parser.add_argument("--report-only", action="store_true", help="write MUTATION.md from the saved results")
    parser.add_argument(
        "--survivors", action="store_true", help="run only the saved run's survivors (the module unchanged)"
    )
    parser.add_argument(
        "--check", action="store_true", help="fail when a saved result is older than its module, or MUTATION.md stale"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument(
        "--fresh", action="store_true", help="test each mutant in a fresh interpreter (not a fork of the warm runner)"
    )
    args = parser.parse_args(argv)
    targets, explained = load_targets()
    if args.check:
        problems = check()
        for line in problems:
            print(line)
        if not problems:
            print(f"{REPORT.relative_to(ROOT)} is up to date with every module it names")
        return 1 if problems else 0
    known = {t["module"]: t for t in targets}
    unknown = [m for m in args.modules if m not in known]
    if unknown:
        parser.error(f"not a target of {TARGETS.relative_to(ROOT)}: {unknown}; targets: {sorted(known)}")
    if not args.report_only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        for module in args.modules or list(known):
            result = run_target(known[module], args.workers, args.survivors, args.fresh)
            previous = json.loads(result_path(module).read_text()) if result_path(module).is_file() else None
            result_path(module).write_text(json.dumps(result, indent=1) + "\n")
            print(f"{module}: {result['counts']}", flush=True)
            notes, missing = carried_explanations(previous, result, explained.get(module, {}))
            TARGETS.write_text(with_explanations(TARGETS.read_text(), module, notes))
            targets, explained = load_targets()
            for m in missing:
                print(f"{module}: unexplained survivor {m['id']}: {m['diff']!r}", flush=True)
            write_report(explained)
    write_report(explained)
    print(f"wrote {REPORT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
