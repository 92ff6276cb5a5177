"""The load generator's HTTP client (tools/bench/sse_client.py) against a raw asyncio server that writes exactly the
bytes a test wants: events split across packets, keep-alive, errors, a server that closes mid-stream."""

import asyncio
import socket

import pytest

from ostinato.tools.bench.sse_client import Connection


async def _serve(handler):
    """A one-off HTTP server on 127.0.0.1; handler(reader, writer, request_number) answers one request."""
    seen = {"connections": 0, "requests": 0}

    async def on_connect(reader, writer):
        seen["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                await reader.readexactly(length)
                seen["requests"] += 1
                if not await handler(reader, writer, seen["requests"]):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_events_arrive_whole_with_their_arrival_time_and_the_connection_is_reused():
    async def handler(reader, writer, n):
        writer.write(STREAM_HEAD + _chunk(b'data: {"a": 1}\n\ndata: {"b"'))  # the second event is split
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(b': 2}\n\n') + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True

    async def main():
        server, url, seen = await _serve(handler)
        conn = Connection(url)
        got = []
        for _ in range(2):
            status, body = await conn.request("POST", "/x", b"{}", lambda e, t: got.append((e, t)), timeout=5)
            assert (status, body) == (200, b"")
        conn.close()
        server.close()
        return got, seen

    got, seen = asyncio.run(main())
    assert [e for e, _ in got] == [b'data: {"a": 1}', b'data: {"b": 2}', b"data: [DONE]"] * 2
    assert got[1][1] - got[0][1] >= 0.04  # the split event is timed when its end arrived
    assert seen == {"connections": 1, "requests": 2}  # kept alive


def test_an_error_answer_returns_its_status_and_body_and_a_closed_connection_is_reopened():
    async def handler(reader, writer, n):
        body = b'{"error": {"message": "slow down"}}'
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                     % len(body) + body)
        await writer.drain()
        return False  # closes the connection

    async def main():
        server, url, seen = await _serve(handler)
        conn = Connection(url)
        answers = [await conn.request("POST", "/x", b"{}", lambda e, t: None, timeout=5) for _ in range(2)]
        conn.close()
        server.close()
        return answers, seen

    answers, seen = asyncio.run(main())
    assert answers == [(429, b'{"error": {"message": "slow down"}}')] * 2
    assert seen == {"connections": 2, "requests": 2}


def test_a_server_that_closes_mid_stream_is_an_error_not_a_hang():
    async def handler(reader, writer, n):
        writer.write(STREAM_HEAD + _chunk(b"data: {}\n\n"))
        await writer.drain()
        return False

    async def main():
        server, url, _ = await _serve(handler)
        try:
            with pytest.raises(ConnectionError):
                await Connection(url).request("POST", "/x", b"{}", lambda e, t: None, timeout=5)
        finally:
            server.close()

    asyncio.run(main())


def test_an_answer_that_arrives_a_byte_at_a_time_parses_whole():
    """Every boundary the parser keeps state across (head, chunk-size line, chunk data, its CRLF, the last chunk)
    split at every byte: the same events, a Content-Length body, and an extension on a chunk-size line."""
    stream = (STREAM_HEAD + b"10;ext=1\r\ndata: {\"a\": 1}\n\n\r\n" + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    plain = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"ok\": true}"[:-1]

    async def handler(reader, writer, n):
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in (stream if n == 1 else plain):
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.0005)  # so that the client reads most bytes alone
        return True

    async def main():
        server, url, seen = await _serve(handler)
        conn = Connection(url)
        got = []
        streamed = await conn.request("POST", "/x", b"{}", lambda e, t: got.append(e), timeout=5)
        answer = await conn.request("GET", "/y", timeout=5)
        conn.close()
        server.close()
        return streamed, answer, got, seen

    streamed, answer, got, seen = asyncio.run(main())
    assert streamed == (200, b"") and got == [b'data: {"a": 1}', b"data: [DONE]"]
    assert answer == (200, b'{"ok": true')
    assert seen == {"connections": 1, "requests": 2}


def test_a_body_framed_by_the_connection_end_and_garbage_instead_of_http():
    async def handler(reader, writer, n):
        if n == 1:
            writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\ndata: 2\n\n")
        else:
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        return False

    async def main():
        server, url, seen = await _serve(handler)
        conn = Connection(url)
        got = []
        first = await conn.request("POST", "/x", b"{}", lambda e, t: got.append(e), timeout=5)
        try:
            with pytest.raises(ConnectionError, match="bad HTTP"):
                await conn.request("POST", "/x", b"{}", lambda e, t: None, timeout=5)
        finally:
            server.close()
        return first, got

    first, got = asyncio.run(main())
    assert first == (200, b"") and got == [b"data: 1", b"data: 2"]
