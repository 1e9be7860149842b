#!/usr/bin/env bash
# The request to send (twice) to `bash examples/demo/run.sh --serve`: an ordinary
# OpenAI chat completion through Envoy, no routing headers; `x-inferencecache-debug: 1`
# asks for the routing decision on the response.
curl -si http://127.0.0.1:10000/v1/chat/completions \
  -H 'content-type: application/json' -H 'x-inferencecache-debug: 1' \
  -d '{"model": "llama-3.2", "messages": [{"role": "system", "content": "You are a concise assistant. Answer in one short paragraph."}, {"role": "user", "content": "What does a KV-cache-aware router do?"}]}'
