"""Read a py-spy ``--format raw`` profile (collapsed stacks, one ``frame;frame;... count`` per
line): the share of samples in each function (self, and with its callees), heaviest first.

    python -m bench.profile_summary <file> [--top 30] [--match lsgd/]
"""

from __future__ import annotations

import argparse
import collections
import sys


def summarize(path: str, top: int, match: str) -> str:
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    out = [f"{total} samples"]
    for title, counter in (("self", own), ("with callees", inclusive)):
        out.append(f"-- {title}")
        shown = 0
        for frame, n in counter.most_common():
            if match and match not in frame:
                continue
            out.append(f"{100 * n / max(total, 1):5.1f}%  {frame}")
            shown += 1
            if shown >= top:
                break
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_summary")
    p.add_argument("file")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--match", default="")
    a = p.parse_args(argv)
    print(summarize(a.file, a.top, a.match))
    return 0


if __name__ == "__main__":
    sys.exit(main())
