"""How fast `tinyllm simulate` runs: N synthetic requests through the real scheduler and block
pool (paged, default config) with the shipped profile; prints requests/s and peak RSS.

    python scripts/sim_speed.py 100000
"""

import resource
import sys
import time

from tinyllm_cli.config import flat_overrides, load_config
from tinyllm_cli.sim.cost import CostModel, default_profile_path
from tinyllm_cli.sim.run import Simulation
from tinyllm_cli.traces import generate_trace

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
arrivals = sys.argv[2] if len(sys.argv) > 2 else "offline"
skip = "--no-skip" not in sys.argv
cost = CostModel.load(default_profile_path())
cfg = load_config(None, flat_overrides({}))
sim = Simulation(cfg, cost, workers=1, skip_ahead=skip)
t0 = time.perf_counter()
done = 0
for _ in sim.run(generate_trace(n, 256, 128, arrivals=arrivals, rate=20.0, seed=0)):
    done += 1
wall = time.perf_counter() - t0
s = sim.summary()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{done} requests ({arrivals}, skip-ahead {'on' if skip else 'off'}) in {wall:.1f} s wall = {done / wall:.0f} req/s; "
      f"{s['steps']} steps ({s['skipped_steps']} skipped ahead), simulated {s['elapsed_s']:.0f} s, "
      f"{s['output_tokens_per_s']:.0f} out tok/s, preemptions {s['preemptions']}, peak RSS {rss:.0f} MiB")
