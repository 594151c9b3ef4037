"""How XLA:CPU runs a PEtab problem's compiled programs, loop body by loop body.

XLA:CPU runs a program as sequences of kernels ("thunks"): the program itself, each
loop's body, each branch of a conditional. A sequence runs kernel after kernel on
the calling thread when it has at most 8 kernels, when every buffer it touches is at
most 512 bytes, or when it is a chain; otherwise as a graph: a kernel is ready once
the kernels it depends on are done, and whenever more than 8 are ready at once the
executor hands half of them to its pool of threads (XLA's `ThunkExecutor`, its
`kSplitThreshold`). In a loop body that runs thousands of times, that hand-over
costs more than the kernels (a few µs each time on 2 cores): Crauste et al. 2017's
gradient took 10-20 ms with its backward loop's body split, 9-10 ms without.

This script compiles `nll` and `jax.grad(nll)` of a problem with XLA's log of its
thunk executors on (`TF_CPP_VMODULE=thunk_executor=6`, in a child process), and
replays each graph's ready queue in XLA's order (first in, first out, each kernel
done at once): for each sequence, its kernels, whether it runs as a graph, the most
kernels ready at once, how many times more than 8 were, and its loops and
conditionals. A body with `> 8` above 0 is one XLA splits at every run. (A replay:
XLA's own order depends on when kernels finish; the log of a large program may be
cut short, marked `cut`.)

    python benchmarks/xla_graphs.py ../shared/data/petab/Laske_PLOSComputBiol2019
    python benchmarks/xla_graphs.py PATH/problem.yaml --program grad --all
"""

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys


_SPLIT = 8  # XLA:CPU's `ThunkExecutor` split threshold (a constant of XLA's)
_HEAD = re.compile(
    r"Constructed ThunkExecutor with (\d+) thunks: .*is_sequential=(\w+)"
)
_THUNK = re.compile(
    r"thunk #(\d+): op_name=(\S+), kind=(\S+), dependencies=\[(.*?)\], source="
)


def _compile(yaml: str, program: str) -> None:
    """The child: compiles the program (XLA's log goes to stderr)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import sciflat

    problem = sciflat.petab_problem(yaml)
    fn = problem.nll if program == "nll" else jax.grad(problem.nll)
    jax.jit(fn).lower(problem.nominal).compile()


def _log(yaml: str, program: str) -> list[str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="thunk_executor=6")
    out = subprocess.run(
        [sys.executable, __file__, yaml, "--child", program],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stderr.splitlines()


def sequences(lines: list[str]) -> list[dict]:
    """Each executor of the log: its size, whether it runs as a graph, its kernels
    `(name, kind, dependencies)`."""
    found: list[dict] = []
    for line in lines:
        head = _HEAD.search(line)
        if head:
            found.append(dict(size=int(head[1]), graph=head[2] == "false", thunks=[]))
            continue
        thunk = _THUNK.search(line)
        if thunk and found:
            deps = [d.strip() for d in thunk[4].split(",") if d.strip()]
            found[-1]["thunks"].append(
                (thunk[2].rstrip(","), thunk[3].rstrip(","), deps)
            )
    return found


def replay(thunks: list[tuple[str, str, list[str]]]) -> tuple[int, int]:
    """The most kernels ready at once after a kernel is taken, and how many times
    that was above the split threshold, with XLA's first-in, first-out queue."""
    first = {}
    for i, (name, _, _) in enumerate(thunks):
        first.setdefault(name, i)
    waits = {
        i: {first[d] for d in deps if d in first}
        for i, (_, _, deps) in enumerate(thunks)
    }
    users = collections.defaultdict(list)
    for i, deps in waits.items():
        for d in deps:
            users[d].append(i)
    left = {i: len(d) for i, d in waits.items()}
    queue = collections.deque(i for i in range(len(thunks)) if not left[i])
    most = over = 0
    while queue:
        i = queue.popleft()
        most = max(most, len(queue))
        over += len(queue) > _SPLIT
        for u in users[i]:
            left[u] -= 1
            if not left[u]:
                queue.append(u)
    return most, over


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("problem", help="a PEtab problem's YAML file or its folder")
    parser.add_argument("--program", choices=("nll", "grad", "both"), default="both")
    parser.add_argument(
        "--all", action="store_true", help="also the sequences run kernel after kernel"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = pathlib.Path(args.problem)
    if path.is_dir():
        named = path / f"{path.name}.yaml"
        path = named if named.is_file() else path / "problem.yaml"
    if args.child:
        _compile(str(path), args.child)
        return
    programs = ("nll", "grad") if args.program == "both" else (args.program,)
    for program in programs:
        found = sequences(_log(str(path), program))
        print(f"{path.stem} {program}: {len(found)} sequences of kernels")
        print("  kernels  runs as  most ready  > 8  loops and conditionals")
        for seq in found:
            if seq["size"] <= _SPLIT or not (seq["graph"] or args.all):
                continue
            most, over = replay(seq["thunks"])
            inner = [
                n for n, kind, _ in seq["thunks"] if kind in ("while", "conditional")
            ]
            cut = " (cut)" if len(seq["thunks"]) < seq["size"] else ""
            how = "graph" if seq["graph"] else "one by one"
            print(
                f"  {seq['size']:7d}  {how:10s} {most:5d}  {over:5d}  "
                f"{', '.join(inner)}{cut}"
            )


if __name__ == "__main__":
    main()
