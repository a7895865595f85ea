"""Gold records of every task of a suite: uncovered required tests, and the share of FAIL_TO_PASS
assertion events judged out of process."""
import asyncio, json, sys, time
from pathlib import Path
from legorl.records import Task, read_jsonl
from legorl.sandbox import make_backend
from legorl.verify import VerifyConfig, gold_record, assertions
from legorl.verify.runner import framing
from legorl.verify.specs import resolve

async def main():
    backend_name, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tasks = list(read_jsonl(Path(path), Task))
    backend = make_backend(backend_name)
    cfg = VerifyConfig(gold_cache=Path("/tmp/goldscan"))
    rows = []
    sem = asyncio.Semaphore(2)
    async def one(task):
        async with sem:
            t0 = time.time()
            grader = resolve(task)
            rec = await gold_record(task, backend=backend, tasks_dir=str(Path(path).parent), run_id="scan", config=cfg, runner_paths=grader.runner_paths())
            row = {"id": task.instance_id, "ok": rec.ok, "reason": rec.reason[:300], "s": round(time.time()-t0, 1)}
            if rec.ok:
                req = task.FAIL_TO_PASS + task.PASS_TO_PASS
                plan = assertions.plan_files(req, rec.sources, **framing(grader), inproc=set(rec.inproc))
                gold = rec.gold()
                cov = assertions.covered_tests(plan, gold)
                row["uncovered"] = [t for t, c in cov.items() if not c]
                for grp, tests in (("f2p", task.FAIL_TO_PASS), ("p2p", task.PASS_TO_PASS)):
                    out_n = tot = 0
                    for t in tests:
                        for e in gold.runs[-1].get(plan.keys.get(t, ""), assertions.TestEvents()).events:
                            site = plan.sites.get(e.site)
                            tot += 1
                            out_n += bool(e.ok is None and site and site.counted and site.mode == "judge")
                    row[grp] = [out_n, tot]
            rows.append(row)
            print(json.dumps(row), flush=True)
    await asyncio.gather(*(one(t) for t in tasks))
    Path(out).write_text(json.dumps(rows, indent=1))
asyncio.run(main())
