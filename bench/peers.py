"""Peers benchmark: flyd's lockstep against the same lockstep over a minimal pyzmq ROUTER broker.

The peer lockstep has flyd's shape: one coordinator, N agents and one arena, each its own
process, every message through one broker process (a pyzmq ROUTER that only swaps the sender and
destination frames). A step is Prepare to every agent (concurrently) -> Advance to the arena ->
Commit to every agent (concurrently), each a JSON request and a JSON reply (orjson). The bytes are
flyd's per-step bytes: the arena renders the counter arena's RGBA8 frame and its audio chunk
(`workers.synthetic.frame`, `workers.synthetic.audio`: 3 072 and 6 400 bytes), base64 in the
Advance reply, and the Commit carries the frame to every agent, which decodes it. The peers do no
validation, deduplication, digests, phases or fencing: the line is what that lean Python
lockstep costs, not a rival runtime.

flyd's figure is `stepsPerSecond` of `flyd run --mode process --checkpoint-every 0 --no-pace`
(stepping time only, launch excluded), as `bench/step_cpu.py` runs it; the peers' is the
coordinator's stepping time after a warm-up. Runs alternate (flyd, peers) in `--repeat` pairs
on this shared host; the line gives medians and ratio = flyd / peers (target >= 0.7), and the
peers' CPU per step (`peer_cpu_ms_per_step`: user + system time of every peer process over the
measured steps), the floor to read `bench/step_cpu.py`'s `cpu_ms_per_step` against:

  {"bench":"peers","agents":N,"flyd_steps_per_s":..,"peer_steps_per_s":..,"ratio":..,
   "peer_cpu_ms_per_step":..,"pairs":[[flyd,peers],..]}

pyzmq is a bench dependency (the dev extra); flyd never imports it. Run it as
`python -P bench/peers.py`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import base64
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import psutil
import zmq

from workers.synthetic.audio import TriangleSource
from workers.synthetic.frame import render_frame

ROOT = Path(__file__).resolve().parent.parent
AGENTS = (2, 32)
AUDIO_FRAMES = 800  # one 60 Hz step of 48 kHz audio, as the counter arena renders it
WARMUP = 100
STOP = b"stop"
PEER_TIMEOUT_S = 600.0


# bench/step_cpu.py by path (the bench runs with -P: `bench/bus.py` would shadow `bus`); it
# loads its own siblings (`sibling`), so that loader is written once, there.
step_cpu = SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "step_cpu.py"),
                                            run_name="bench_step_cpu"))
scaling = step_cpu.scaling


# ---------------------------------------------------------------------------------------------
# peer processes


def broker(address: str) -> None:
    """ROUTER: [sender, destination, body] in, [destination, sender, body] out."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(address)
    while True:
        sender, destination, body = router.recv_multipart(copy=False)
        router.send_multipart([destination, sender, body], copy=False)


def _dealer(address: str, identity: str) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def agent(address: str, agent_id: str) -> None:
    """Prepare -> a decision; Commit -> decode the frame, telemetry back."""
    _, sock = _dealer(address, agent_id)
    ticks = 0
    while True:
        sender, body = sock.recv_multipart()
        if body == STOP:
            return
        request = orjson.loads(body)
        if request["method"] == "Prepare":
            ticks += 2
            result: dict[str, Any] = {
                "agentId": agent_id, "ticksAdvanced": "2", "brainTicks": str(ticks),
                "decision": {"schema": {"id": "arena.decision", "version": 1},
                             "value": {"press": "inc" if ticks % 3 else "dec"}}}
        else:
            frame = base64.b64decode(request["params"]["view"])
            result = {"agentId": agent_id, "committedStep": request["params"]["boundary"],
                      "telemetry": {"brainTicks": str(ticks), "frameBytes": len(frame)}}
        sock.send_multipart([sender, orjson.dumps({"id": request["id"], "result": result})])


def arena(address: str) -> None:
    """Advance -> apply the controls, render the frame and the audio chunk, base64 both."""
    _, sock = _dealer(address, "arena")
    counter = 0
    source = TriangleSource()
    while True:
        sender, body = sock.recv_multipart()
        if body == STOP:
            return
        request = orjson.loads(body)
        params = request["params"]
        counter += sum(1 if c["press"] == "inc" else -1 for c in params["controls"])
        boundary = int(params["step"]) + 1
        frame = render_frame(counter, boundary)
        audio = source.chunk(counter, AUDIO_FRAMES)
        result = {"boundary": str(boundary), "counter": counter,
                  "view": base64.b64encode(frame).decode("ascii"),
                  "audio": base64.b64encode(audio).decode("ascii")}
        sock.send_multipart([sender, orjson.dumps({"id": request["id"], "result": result})])


def _cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU of the peers (every thread: libzmq's I/O thread included)."""
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def coordinator(address: str, agents: int, steps: int, peer_pids: list[int]) -> None:
    """The lockstep; prints {"steps":..,"seconds":..,"cpu_s":..} for the steps after the
    warm-up (`cpu_s`: every peer process, this one and the broker included)."""
    procs = [psutil.Process(), *(psutil.Process(pid) for pid in peer_pids)]
    _, sock = _dealer(address, "coordinator")
    ids = [f"a{i}".encode() for i in range(1, agents + 1)]
    serial = 0

    def ask(targets: list[bytes], method: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal serial
        pending: dict[int, bytes] = {}
        for target in targets:
            serial += 1
            pending[serial] = target
            body = {"id": serial, "method": method,
                    "params": {**params, "agentId": target.decode()}}
            sock.send_multipart([target, orjson.dumps(body)])
        replies: dict[bytes, dict[str, Any]] = {}
        while pending:
            if not sock.poll(int(PEER_TIMEOUT_S * 1000)):
                raise RuntimeError(f"{method}: no reply within {PEER_TIMEOUT_S} s")
            _, raw = sock.recv_multipart()
            reply = orjson.loads(raw)
            replies[pending.pop(reply["id"])] = reply["result"]
        return [replies[t] for t in targets]

    started = cpu_at_start = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            started = time.perf_counter()
            cpu_at_start = _cpu_s(procs)
        decisions = ask(ids, "Prepare", {"step": str(step), "interval": {"ns": "16666666"}})
        controls = [{"port": f"p{i}", "press": d["decision"]["value"]["press"]}
                    for i, d in enumerate(decisions, 1)]
        (observation,) = ask([b"arena"], "Advance", {"step": str(step), "controls": controls})
        ask(ids, "Commit", {"boundary": observation["boundary"], "view": observation["view"]})
    seconds = time.perf_counter() - started
    cpu_s = _cpu_s(procs) - cpu_at_start
    for target in [*ids, b"arena"]:
        sock.send_multipart([target, STOP])
    time.sleep(0.2)  # let the stops leave before the context is torn down
    print(orjson.dumps({"steps": steps, "seconds": seconds, "cpu_s": cpu_s}).decode(),
          flush=True)


# ---------------------------------------------------------------------------------------------
# orchestration


def _role(*args: str) -> list[str]:
    return [sys.executable, "-P", str(Path(__file__).resolve()), "--role", *args]


def peer_run(tmp: Path, agents: int, steps: int) -> tuple[float, float]:
    """(steps/s, CPU ms per step of every peer process) after the warm-up."""
    address = f"ipc://{tmp / 'peers.ipc'}"
    procs = [subprocess.Popen(_role("broker", address))]
    try:
        procs.append(subprocess.Popen(_role("arena", address)))
        procs += [subprocess.Popen(_role("agent", address, f"a{i}"))
                  for i in range(1, agents + 1)]
        time.sleep(1.0 + agents * 0.1)  # every DEALER connected before the first send
        pids = ",".join(str(p.pid) for p in procs)
        out = subprocess.run(_role("coordinator", address, str(agents), str(steps), pids),
                             capture_output=True, check=True, timeout=PEER_TIMEOUT_S)
        result = orjson.loads(out.stdout)
        steps_done = float(result["steps"])
        return steps_done / float(result["seconds"]), 1000.0 * float(result["cpu_s"]) / steps_done
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def flyd_steps_per_s(tmp: Path, dsn: str, agents: int, steps: int) -> float:
    _, advances, summary = step_cpu.run_cpu(tmp, dsn, agents, 0, steps)
    if advances != steps:
        raise RuntimeError(f"flyd run with {agents} agents made {advances}/{steps} advances: "
                           f"{summary['failures']}")
    return float(summary["stepsPerSecond"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--agents", type=int, nargs="+", default=list(AGENTS))
    ap.add_argument("--repeat", type=int, default=2, help="(flyd, peers) pairs per count")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the run lengths")
    ap.add_argument("--agents-per-process", type=int, default=1,
                    help="flyd's agents per worker process (agent hosts)")
    args = ap.parse_args()
    if args.role:
        role, *rest = args.role
        if role == "broker":
            broker(rest[0])
        elif role == "arena":
            arena(rest[0])
        elif role == "agent":
            agent(rest[0], rest[1])
        else:
            coordinator(rest[0], int(rest[1]), int(rest[2]),
                        [int(pid) for pid in rest[3].split(",")])
        return
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    try:
        with scaling.scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(scaling.config_text(max(args.agents),
                                                               args.agents_per_process))
            for agents in args.agents:
                _, steps = step_cpu.lengths(agents, args.scale)
                pairs: list[tuple[float, float]] = []
                peer_cpu: list[float] = []
                for _ in range(args.repeat):
                    scaling.progress(f"{agents} agents: flyd, {steps} steps")
                    ours = flyd_steps_per_s(tmp, dsn, agents, steps)
                    scaling.progress(f"{agents} agents: peers, {steps} steps")
                    theirs, cpu_ms = peer_run(tmp, agents, steps)
                    pairs.append((ours, theirs))
                    peer_cpu.append(cpu_ms)
                flyd_rate = statistics.median(p[0] for p in pairs)
                peer_rate = statistics.median(p[1] for p in pairs)
                scaling.emit({"bench": "peers", "agents": agents,
                              "agents_per_process": args.agents_per_process,
                              "flyd_steps_per_s": round(flyd_rate, 1),
                              "peer_steps_per_s": round(peer_rate, 1),
                              "ratio": round(flyd_rate / peer_rate, 3),
                              "peer_cpu_ms_per_step": round(statistics.median(peer_cpu), 3),
                              "pairs": [[round(a, 1), round(b, 1)] for a, b in pairs]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
