"""The main thread of call 2's profiled step run (py-spy raw output, 50 Hz, idle stacks included), folded
to the innermost frames under curation.decode.embed_batches: where the step's host spent its time.
Usage: python pyspy_summary.py pyspy_1.txt  (the raw file, 3 MB, is not kept; its summary is pyspy_summary.txt)"""
import collections
import sys

frames, lines, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if "embed_batches (" not in stack:
        continue
    n = int(n)
    total += n
    inner = stack.split("embed_batches (", 1)[1].split(";")
    frames[";".join(f.split(" (")[0] for f in inner[1:3]) or "(embed_batches itself)"] += n
    if ";_host (" in stack:
        lines["_host at " + stack.split(";_host (", 1)[1].split(";")[0].rstrip(")")] += n
print(f"{total} samples of the main thread inside embed_batches (50 Hz)")
for k, v in frames.most_common(15):
    print(f"{v:6d} {100 * v / total:5.1f}%  {k}")
print("\nwithin _host, by source line (curation/decode.py at 2907006: 612 done.synchronize(), 613 e.cpu())")
for k, v in lines.most_common(5):
    print(f"{v:6d}  {k}")
