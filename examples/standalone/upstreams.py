"""Three stand-in model replicas for the standalone demo.

Each answers any request with the replica id that served it and the routing
headers Envoy forwarded, so a `curl` through Envoy shows where it went.
Ports 18001-18003 match examples/standalone/policy.yaml and envoy/override-host.yaml.
"""

import http.server
import threading

REPLICAS = {"replica-a": 18001, "replica-b": 18002, "replica-c": 18003}


def serve(replica: str, port: int) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            reason = self.headers.get("x-inferencecache-reason", "-")
            body = f"served by {replica} (reason seen upstream: {reason})\n".encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    for name, port in REPLICAS.items():
        threading.Thread(target=serve, args=(name, port), daemon=True).start()
    print("upstreams listening on 127.0.0.1:18001-18003", flush=True)
    threading.Event().wait()
