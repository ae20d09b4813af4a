"""HTTP bridge to grpc.health.v1 for load balancers that cannot speak gRPC.

GET on any path calls Health/Check (service "") on the local ragkv server and
answers 200 while it reports SERVING, 503 otherwise (NOT_SERVING, unreachable,
or slower than the timeout). It knows nothing about ragkv beyond the standard
health service, which the server exempts from bearer-token auth.

Usage: grpc_health_http.py LISTEN_PORT GRPC_TARGET
"""

import http.server
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 2.0  # seconds; below the target group's health-check timeout


def main() -> None:
    listen_port, target = int(sys.argv[1]), sys.argv[2]
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's method name
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                serving = False
            body = b"SERVING\n" if serving else b"NOT_SERVING\n"
            self.send_response(200 if serving else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one request every few seconds per load balancer node: keep the journal quiet

    http.server.ThreadingHTTPServer(("0.0.0.0", listen_port), Handler).serve_forever()


if __name__ == "__main__":
    main()
