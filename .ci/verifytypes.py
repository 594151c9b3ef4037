"""Fails if `pyright --verifytypes` finds less of sciflat's public API typed than asked.

Usage: `python .ci/verifytypes.py MIN_PERCENT`. The score is the share of exported
symbols whose types a user's checker can read completely (`--ignoreexternal`: gaps in
JAX's or Equinox's own annotations do not count against us).
"""

import json
import subprocess
import sys


minimum = float(sys.argv[1])
proc = subprocess.run(
    ["pyright", "--verifytypes", "sciflat", "--ignoreexternal", "--outputjson"],
    capture_output=True,
    text=True,
)
report = json.loads(proc.stdout)
score = 100 * report["typeCompleteness"]["completenessScore"]
print(f"pyright --verifytypes sciflat: {score:.1f}% of the public API typed")
if score < minimum:
    for symbol in report["typeCompleteness"]["symbols"]:
        if symbol["isExported"] and not symbol["isTypeKnown"]:
            messages = "; ".join(d["message"] for d in symbol["diagnostics"])
            print(f"  {symbol['name']}: {messages}")
    sys.exit(f"below the {minimum:.0f}% required: annotate the symbols above.")
