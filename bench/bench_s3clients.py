"""Which S3 client for the G4 tier: boto3 vs obstore (threads) vs obstore (asyncio).

Starts its own SeaweedFS (``weed mini``) and puts then gets the same number of objects of
64 KiB, 256 KiB and 2 MiB with 8 and 16 requests in flight, through each client:

* ``boto3``: one shared client (thread-safe), ``max_pool_connections`` 32, its CRC32
  request/response checksums off (kvstrata verifies its own xxh3-64), in a thread pool; only
  if ``boto3`` is installed (``pip install boto3==1.44.5``; not a kvstrata dependency);
* ``obstore``: blocking ``obstore.put``/``obstore.get(...).bytes()`` in a thread pool (the
  GIL is released while a request runs) -- what :mod:`kvstrata.physical.storage.s3client`
  uses;
* ``obstore-async``: ``put_async``/``get_async`` under ``asyncio.gather`` with a semaphore.

Payload GB/s, best of ``--reps``, clients interleaved. The figures decided the client; they are
quoted in :mod:`kvstrata.physical.storage.s3client`.
Usage: ``python bench/bench_s3clients.py [--quick] [--reps N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import obstore

from kvstrata.physical.storage.s3client import S3Client
from kvstrata.physical.storage.seaweed import SeaweedServer


def boto3_ops(server: SeaweedServer):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    client = boto3.client(
        "s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1},
                      max_pool_connections=32, s3={"addressing_style": "path"},
                      request_checksum_calculation="when_required",
                      response_checksum_validation="when_required"))
    bucket = server.bucket
    return (lambda k, b: client.put_object(Bucket=bucket, Key=k, Body=b),
            lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read())


def threaded(put, get, keys, body, concurrency) -> tuple[float, float]:
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        list(pool.map(lambda k: put(k, body), keys))
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        out = list(pool.map(get, keys))
        get_s = time.perf_counter() - start
    assert all(len(o) == len(body) for o in out)
    return put_s, get_s


def asynchronous(store, keys, body, concurrency) -> tuple[float, float]:
    async def run() -> tuple[float, float]:
        gate = asyncio.Semaphore(concurrency)

        async def put(k):
            async with gate:
                await obstore.put_async(store, k, body, use_multipart=False)

        async def get(k):
            async with gate:
                return await (await obstore.get_async(store, k)).bytes_async()

        start = time.perf_counter()
        await asyncio.gather(*map(put, keys))
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        out = await asyncio.gather(*map(get, keys))
        get_s = time.perf_counter() - start
        assert all(len(o) == len(body) for o in out)
        return put_s, get_s

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    parser.add_argument("--reps", type=int, default=None, help="runs per figure (best of)")
    args = parser.parse_args()
    total, reps = (16 << 20, 1) if args.quick else (128 << 20, 2)
    reps = args.reps or reps
    with SeaweedServer() as server:
        store = S3Client(server.s3_config()).store
        clients = {"obstore": (lambda k, b: obstore.put(store, k, b, use_multipart=False),
                               lambda k: obstore.get(store, k).bytes())}
        boto = boto3_ops(server)
        if boto is not None:
            clients = {"boto3": boto, **clients}
        else:
            print("boto3 not installed: skipped")
        print(f"SeaweedFS {server.endpoint_url}; best of {reps}; payload GB/s put / get")
        for size in (64 << 10, 256 << 10, 2 << 20):
            n = max(32, total // size)
            body = os.urandom(size)
            for concurrency in (8, 16):
                best: dict[str, list[float]] = {}
                for rep in range(reps + 1):                 # round 0 warms up
                    for name, (put, get) in [*clients.items(), ("obstore-async", (None, None))]:
                        keys = [f"{name}/{size}/{concurrency}/{rep}/{i}" for i in range(n)]
                        if put is None:
                            times = asynchronous(store, keys, body, concurrency)
                        else:
                            times = threaded(put, get, keys, body, concurrency)
                        if rep:
                            old = best.get(name, [float("inf")] * 2)
                            best[name] = [min(a, b) for a, b in zip(old, times)]
                cells = "  ".join(f"{name} {n * size / p / 1e9:.3f} / {n * size / g / 1e9:.3f}"
                                  for name, (p, g) in best.items())
                print(f"  {size >> 10:5d} KiB x{n:4d}, {concurrency:2d} in flight: {cells}",
                      flush=True)


if __name__ == "__main__":
    main()
