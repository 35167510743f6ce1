# Prints the SASS lines of an ncu --page source --csv report with the most stall samples.
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
header_i = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
h = rows[header_i]
src = h.index("Source")
cols = [i for i, c in enumerate(h) if "Warp Stall Sampling (All" in c]
samp = cols[0]
data = []
for r in rows[header_i + 1:]:
    if len(r) <= max(src, samp): continue
    try: v = float(r[samp] or 0)
    except ValueError: continue
    data.append((v, r[0], r[src]))
total = sum(d[0] for d in data)
print("total samples", total)
for v, a, s in sorted(data, reverse=True)[:45]:
    print(f"{v:8.0f} {100*v/total:5.1f}% {a} {s[:110]}")
