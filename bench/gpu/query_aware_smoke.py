"""GPU smoke run of quest/asyncspade/lfps through a real sgl_sparse server (eager:
--disable-cuda-graph), on the random-weights model of run_all.sh e2e. Checks: budgets
covering the sequence reproduce `full` token for token; small budgets are served
(the two-segment kernel's indexed segment A); decode timings of full vs the three
policies in the same eager server (not comparable to CUDA-graph runs).

    python3 bench/gpu/make_random_model.py --shape qwen3-1.7b --out /root/model --max-pos 40000
    python3 bench/gpu/query_aware_smoke.py     # writes $OUT/qa_smoke.json, $OUT/server.log
"""
import json, os, random, subprocess, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_compare import batch_wall, check_port_free, gen, scrape, sparse_stats, wait_ready  # noqa: E402

out = os.environ.get("OUT", "/tmp/out")
cfg = os.path.join(out, "qa.yaml")
open(cfg, "w").write(open("bench/gpu/sparse_config.yaml").read() + """
query_aware:
  quest: {slots: 8, max_context: 16384, capacity: 8200}
  asyncspade: {slots: 8, max_context: 16384, capacity: 8200}
  lfps: {slots: 8, max_context: 16384, capacity: 8200, candidates: 4096}
""")
url = "http://127.0.0.1:30111"
cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/root/model", "--attention-backend", "sgl_sparse",
       "--skip-tokenizer-init", "--port", "30111", "--mem-fraction-static", "0.7", "--enable-metrics",
       "--disable-radix-cache", "--disable-cuda-graph", "--sparse-config", cfg]
log = open(os.path.join(out, "server.log"), "w")
check_port_free(30111)
proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
res = {"cmd": " ".join(cmd)}
try:
    res["ready_s"] = round(wait_ready(url, proc, 420), 1)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(n)] for n in (300, 1500, 4000)]
    full = [gen(url, p, 32)["output_ids"] for p in prompts]
    res["covering_equal_full"] = {}
    for pol in ({"policy": "quest", "budget": 8192}, {"policy": "asyncspade", "budget": 8192},
                {"policy": "lfps", "budget": 8192}):
        got = [gen(url, p, 32, pol)["output_ids"] for p in prompts]
        res["covering_equal_full"][pol["policy"]] = [g == f for g, f in zip(got, full)]
    res["sparse_differs_from_full"] = {}
    for pol in ({"policy": "quest", "budget": 64, "recent": 16}, {"policy": "asyncspade", "budget": 64, "recent": 16},
                {"policy": "lfps", "budget": 64}):
        got = [gen(url, p, 32, pol)["output_ids"] for p in prompts]
        res["sparse_differs_from_full"][pol["policy"]] = [g != f for g, f in zip(got, full)]
    print(json.dumps(res), flush=True)
    ctx, bs, n_out = 8192, 4, 64
    ps = [[rng.randrange(1000, 100000) for _ in range(ctx)] for _ in range(bs)]
    res["cases"] = []
    for label, pol in (("full", None), ("quest", {"policy": "quest", "budget": 2048}),
                       ("asyncspade", {"policy": "asyncspade", "budget": 2048}),
                       ("lfps", {"policy": "lfps", "budget": 2048})):
        batch_wall(url, ps[:1], 2, pol)
        t1 = batch_wall(url, ps, 1, pol)
        before = scrape(url)
        tl = batch_wall(url, ps, n_out, pol)
        row = {"ctx": ctx, "batch": bs, "policy": label, "t_prefill_s": round(t1, 3), "t_total_s": round(tl, 3),
               "decode_tok_s": round(bs * (n_out - 1) / max(tl - t1, 1e-9), 1),
               **sparse_stats(before, scrape(url), (pol or {}).get("policy", "full"))}
        res["cases"].append(row)
        print(json.dumps(row), flush=True)
finally:
    json.dump(res, open(os.path.join(out, "qa_smoke.json"), "w"), indent=1)
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
