"""Publishes KV events with an engine's own publisher: vLLM's or SGLang's `kv_events.py` (fetched by
scripts/engine-kv-events.sh), its `ZmqEventPublisher` and its event classes, encoded by msgspec over pyzmq exactly as
the engine does. The engines themselves are not installed: the few names each file imports from the rest of its
package (a logger, a config holder, address helpers the publisher does not call here) are supplied as stand-ins
before the file is loaded; nothing that touches the wire is replaced.

    python3 engine_kv_publisher.py --engine vllm --source DIR [--pub-port P --replay-port R --health-port H]
                                   [--ranks N]

Binds the publisher's two sockets and serves `GET /health` (so a router sees a live server) on 127.0.0.1, on the
ports given or, for each left at 0, on one the system picks as it binds (a port found free beforehand may be taken
by another process before it is bound); then prints `ready PUB REPLAY H` (the two endpoints bound and the health
port) and reads one JSON command per line on stdin, answering each with a line once the publisher has sent it.
With `--ranks N`, a server of N data-parallel ranks: one publisher per rank, each made by the engine's class for its
rank from the same two endpoints (the class offsets each port by the rank), on two base ports chosen here, which
`ready` names; a command's `"rank"` (default 0) says which rank publishes it:
    {"op": "store", "hashes": [...], "parent": null, "tokens": [...], "block_size": 16, "medium": "GPU",
     "salt": null}
        (a hash is an integer, or {"bytes": n} for n as 32 bytes, like vLLM's SHA-256 hashes; a salt is the request's
        cache_salt, as each engine publishes it: vLLM as the only extra key of a chain's first block, SGLang as the
        event's field)
    {"op": "remove", "hashes": [...], "medium": "GPU"}
    {"op": "clear"}
    {"op": "skip"}   # burns a sequence number: subscribers see a batch missing that no replay can return
"""

import argparse
import importlib.util
import json
import logging
import random
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq


def stand_ins(engine):
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    class Holder:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    if engine == "vllm":
        for name in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"]:
            module(name)
        module("vllm.config.kv_events", KVEventsConfig=Holder)
        module("vllm.logger", init_logger=logging.getLogger)
        module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
        unused = lambda *a, **k: None  # noqa: E731  (address helpers for wildcard binds, not used on loopback)
        module("vllm.utils.network_utils", get_ip=unused, get_tcp_uri=unused, is_valid_ipv6_address=unused,
               split_zmq_path=unused)
    else:
        for name in ["sglang", "sglang.srt", "sglang.srt.utils"]:
            module(name)
        module("sglang.srt.runtime_context", get_parallel=lambda: None)
        module("sglang.srt.utils.network", NetworkAddress=Holder)


def load(engine, source):
    stand_ins(engine)
    spec = importlib.util.spec_from_file_location(f"{engine}_kv_events", f"{source}/{engine}/kv_events.py")
    kv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv)
    return kv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--pub-port", type=int, default=0)
    p.add_argument("--replay-port", type=int, default=0)
    p.add_argument("--health-port", type=int, default=0)
    p.add_argument("--topic", default="")
    p.add_argument("--ranks", type=int, default=1)
    args = p.parse_args()
    kv = load(args.engine, args.source)

    # ZeroMQ's wildcard port: bound to one the system picks.
    pub_endpoint = f"tcp://127.0.0.1:{args.pub_port or '*'}"
    replay_endpoint = f"tcp://127.0.0.1:{args.replay_port or '*'}"
    # The endpoints the publisher's sockets were bound to, read as it sets them up (before its thread starts, which
    # alone uses the sockets afterwards).
    bound = {}
    setup = kv.ZmqEventPublisher._socket_setup

    def recording_setup(self):
        setup(self)
        bound["pub"] = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        bound["replay"] = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    kv.ZmqEventPublisher._socket_setup = recording_setup
    if args.engine == "vllm":
        # vLLM binds wildcard endpoints and connects to concrete ones; bind this one on loopback.
        kv.ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda endpoint: True)

    def publisher_for(rank, pub, replay):
        if args.engine == "vllm":
            return kv.ZmqEventPublisher(rank, endpoint=pub, replay_endpoint=replay, topic=args.topic)
        return kv.ZmqEventPublisher(rank, endpoint=pub, replay_endpoint=replay, topic=args.topic, bind=True)

    if args.ranks == 1:
        publishers = [publisher_for(0, pub_endpoint, replay_endpoint)]
    else:
        # Two base ports whose next N-1 are free too: the engine's class offsets each rank's by its rank, so the
        # wildcard port is no use; tried until every rank binds.
        rng = random.Random()
        for _ in range(100):
            pub_port, replay_port = rng.randrange(20000, 40000, 16), rng.randrange(40000, 60000, 16)
            base = (f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
            publishers = []
            try:
                for rank in range(args.ranks):
                    publishers.append(publisher_for(rank, *base))
            except zmq.ZMQError:
                for made in publishers:
                    made.shutdown()
                continue
            bound["pub"], bound["replay"] = base
            break
        else:
            sys.exit("no free ports for the ranks' publishers")

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.health_port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"ready {bound['pub']} {bound['replay']} {server.server_address[1]}", flush=True)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        publisher = publishers[cmd.get("rank", 0)]
        if op == "skip":
            next(publisher._seq_gen)
            print("ok", flush=True)
            continue
        def block_hash(h):
            # {"bytes": n}: a 32-byte hash, as vLLM's default SHA-256 block hashes.
            return h["bytes"].to_bytes(32, "big") if isinstance(h, dict) else h

        if op == "store":
            cmd["hashes"] = [block_hash(h) for h in cmd["hashes"]]
            cmd["parent"] = block_hash(cmd["parent"]) if cmd.get("parent") is not None else None
            fields = dict(block_hashes=cmd["hashes"], parent_block_hash=cmd.get("parent"), token_ids=cmd["tokens"],
                          block_size=cmd["block_size"], lora_id=None, medium=cmd.get("medium"))
            salt = cmd.get("salt")
            if args.engine == "vllm":
                fields["lora_name"] = None
                if salt is not None and fields["parent_block_hash"] is None:
                    fields["extra_keys"] = [(salt,)] + [None] * (len(cmd["hashes"]) - 1)
            elif salt is not None:
                fields["cache_salt"] = salt
            event = kv.BlockStored(**fields)
        elif op == "remove":
            cmd["hashes"] = [block_hash(h) for h in cmd["hashes"]]
            event = kv.BlockRemoved(block_hashes=cmd["hashes"], medium=cmd.get("medium"))
        else:
            event = kv.AllBlocksCleared()
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[event]))
        while not publisher._event_queue.empty():
            time.sleep(0.005)
        time.sleep(0.02)
        print("ok", flush=True)


if __name__ == "__main__":
    main()
