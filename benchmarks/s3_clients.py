"""The S3 clients a checkpoint could move its bytes with, on one store: which one the drain and
the restore use (docs/benchmarks.md, "S3 clients").

Starts SeaweedFS on loopback (as benchmarks/s3_bench.py), then, interleaved for --rounds rounds,
each in a fresh process: a PUT of one --size object as a multipart upload (--part-size parts,
--threads in flight) and a GET of it in ranged reads of --part-size (--threads in flight), with

    s3fs       fsspec's s3fs (aiobotocore on its event loop): pipe_file, cat_ranges
    botocore   botocore on threads: upload_part with x-amz-checksum-crc32c, no signed payload,
               ranged GETs read into reused buffers (dcp_nvme.tiers.s3_client)
    obstore    obstore (Rust object_store): put with max_concurrency, get_ranges
    crt        the CRT client under s3torchconnector: put_object writer, get_object reader

GB/s and CPU seconds per GB (the process's user+system over the operation, the client's
construction included, its imports not).

    python benchmarks/s3_clients.py --size 512MiB --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CLIENTS = ("s3fs", "botocore", "obstore", "crt")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ranges(size: int, part: int) -> list[tuple[int, int]]:
    return [(start, min(size, start + part)) for start in range(0, size, part)]


def child(client: str, op: str, key: str, options: dict[str, Any], size: int, part: int, threads: int) -> dict:
    endpoint, region = options["endpoint_url"], options["client_kwargs"]["region_name"]
    data = os.urandom(size) if op == "put" else b""
    if client == "s3fs":
        import s3fs
    elif client == "botocore":
        import crc32c

        from dcp_nvme.tiers import s3_client
    elif client == "obstore":
        import obstore
        from obstore.store import S3Store
    else:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
    cpu, started = _cpu(), time.perf_counter()
    got = 0
    if client == "s3fs":
        fs = s3fs.S3FileSystem(**options)
        if op == "put":
            fs.pipe_file(f"bench/{key}", data, chunksize=part)
        else:
            spans = _ranges(size, part)
            got = sum(map(len, fs.cat_ranges([f"bench/{key}"] * len(spans), [s for s, _ in spans],
                                             [e for _, e in spans])))
    elif client == "botocore":
        folder, name = key.rsplit("/", 1)
        store = s3_client.object_store(f"s3://bench/{folder}", options)
        assert store is not None
        c = store.client
        if op == "put":
            upload = c.create_multipart_upload(Bucket="bench", Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]
            view = memoryview(data)

            def put(index: int, span: tuple[int, int]) -> dict:
                body = view[span[0]:span[1]].tobytes()
                crc = s3_client.b64_crc(crc32c.crc32c(body))
                answer = c.upload_part(Bucket="bench", Key=key, UploadId=upload, PartNumber=index + 1, Body=body,
                                       ChecksumCRC32C=crc)
                return {"PartNumber": index + 1, "ETag": answer["ETag"], "ChecksumCRC32C": crc}

            with ThreadPoolExecutor(threads) as pool:
                parts = list(pool.map(put, *zip(*enumerate(_ranges(size, part)))))
            c.complete_multipart_upload(Bucket="bench", Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
        else:
            import threading

            local = threading.local()

            def get(span: tuple[int, int]) -> int:
                buffer = getattr(local, "buffer", None) or bytearray(part)
                local.buffer = buffer
                return store.read_into(name, span[0], memoryview(buffer)[: span[1] - span[0]])

            with ThreadPoolExecutor(threads) as pool:
                got = sum(pool.map(get, _ranges(size, part)))
    elif client == "obstore":
        store_ = S3Store("bench", endpoint=endpoint, region=region, access_key_id=options["key"],
                         secret_access_key=options["secret"], client_options={"allow_http": True},
                         virtual_hosted_style_request=False)
        if op == "put":
            obstore.put(store_, key, data, chunk_size=part, max_concurrency=threads)
        else:
            spans = _ranges(size, part)
            got = sum(len(b) for b in obstore.get_ranges(store_, key, starts=[s for s, _ in spans],
                                                          ends=[e for _, e in spans]))
    else:
        os.environ.update(AWS_ACCESS_KEY_ID=options["key"], AWS_SECRET_ACCESS_KEY=options["secret"])
        crt = S3Client(region, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True,
                                                                                   part_size=part))
        if op == "put":
            writer = crt.put_object("bench", key)
            writer.write(data)
            writer.close()
        else:
            reader = crt.get_object("bench", key)
            while chunk := reader.read(part):
                got += len(chunk)
    seconds, cpu = time.perf_counter() - started, _cpu() - cpu
    if op == "get" and got != size:
        raise SystemExit(f"{client} get: {got} of {size} bytes")
    return {"client": client, "op": op, "seconds": seconds, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part-size", default="16MiB")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record = child(**json.loads(args.child))
        print(json.dumps(record))
        return record
    from dcp_nvme.config import parse_size

    size, part = parse_size(args.size), parse_size(args.part_size)
    from s3_bench import bench_store  # its sibling in benchmarks/, the script's own directory

    runs: list[dict[str, Any]] = []
    clients = args.clients.split(",")
    with bench_store("s3-clients-") as (options, env, _):
        for round_ in range(args.rounds):
            for client in clients:
                for op in ("put", "get"):
                    spec = {"client": client, "op": op, "key": f"r{round_}/{client}", "options": options,
                            "size": size, "part": part, "threads": args.threads}
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                                         capture_output=True, text=True, env=env)
                    if out.returncode != 0:
                        raise SystemExit(f"s3_clients: {client} {op} failed:\n{out.stderr[-3000:]}")
                    record = json.loads(out.stdout.strip().splitlines()[-1])
                    record.update(gbps=size / 1e9 / record["seconds"], cpu_s_per_gb=record["cpu_s"] / (size / 1e9))
                    runs.append(record)
                    print(f"round {round_} {client:8s} {op} {record['gbps']:.3f} GB/s "
                          f"{record['cpu_s_per_gb']:.2f} CPU s/GB", flush=True)
    summary = {f"{c} {op}": {"gbps": statistics.median(r["gbps"] for r in runs if r["client"] == c and r["op"] == op),
                             "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in runs
                                                               if r["client"] == c and r["op"] == op)}
               for c in clients for op in ("put", "get")}
    report = {"config": {"size": size, "part_size": part, "threads": args.threads, "rounds": args.rounds},
              "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
