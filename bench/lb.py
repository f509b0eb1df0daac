"""A plain HTTP load balancer for the scale bench: what a team puts in front of several llama-servers when
it has no slot keeping. Per request (not per connection: agents keep connections alive), `round-robin` takes
the next server, `least-conn` the server with the fewest requests in flight. Bodies pass untouched, answers
stream back chunk by chunk.

    python -m bench.lb --port 8090 --policy round-robin http://127.0.0.1:8080 http://127.0.0.1:8081
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import httpx

HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}


class Balancer:
    def __init__(self, servers: list[str], policy: str) -> None:
        self.servers = servers
        self.policy = policy
        self.turn = itertools.cycle(range(len(servers)))
        self.inflight = [0] * len(servers)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))

    def pick(self) -> int:
        if self.policy == "least-conn":
            return min(range(len(self.servers)), key=lambda i: (self.inflight[i], i))
        return next(self.turn)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, target, _ = lines[0].split(b" ", 2)
                headers = [tuple(x.split(b":", 1)) for x in lines[1:] if b":" in x]
                length = next((int(v) for k, v in headers if k.strip().lower() == b"content-length"), 0)
                body = await reader.readexactly(length) if length else b""
                i = self.pick()
                self.inflight[i] += 1
                try:
                    await self.forward(i, method.decode(), target.decode(), headers, body, writer)
                finally:
                    self.inflight[i] -= 1
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def forward(self, i: int, method: str, target: str, headers: list[tuple[bytes, ...]], body: bytes,
                      writer: asyncio.StreamWriter) -> None:
        keep = [(k.strip(), v.strip()) for k, v in headers if k.strip().lower() not in HOP]
        req = self.client.build_request(method, self.servers[i] + target, content=body, headers=keep)
        resp = await self.client.send(req, stream=True)
        try:
            out = [f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}".encode()]
            out += [k + b": " + v for k, v in resp.headers.raw if k.lower() not in HOP]
            out += [b"transfer-encoding: chunked", b"", b""]
            writer.write(b"\r\n".join(out))
            async for chunk in resp.aiter_raw():
                if chunk:
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            await resp.aclose()


async def serve(port: int, servers: list[str], policy: str) -> None:
    lb = Balancer(servers, policy)
    server = await asyncio.start_server(lb.handle, "127.0.0.1", port)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--policy", choices=["round-robin", "least-conn"], default="round-robin")
    ap.add_argument("servers", nargs="+")
    a = ap.parse_args()
    asyncio.run(serve(a.port, [s.rstrip("/") for s in a.servers], a.policy))


if __name__ == "__main__":
    main()
