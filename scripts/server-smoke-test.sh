#!/usr/bin/env bash
# Smoke-test a running gpullama-serve with curl: health, models, chat, completion, stream, 400s, 405, 5 parallel.
# Usage: scripts/server-smoke-test.sh [HOST[:PORT] | URL]   (default 127.0.0.1:8080; $GPULLAMA_API_KEY is sent if set)
# Prints "N passed, N failed"; the exit status is 1 when anything failed.
set -uo pipefail

target="${1:-127.0.0.1:8080}"
case "$target" in http://*|https://*) base="${target%/}" ;; *) base="http://${target%/}" ;; esac
auth=()
[ -n "${GPULLAMA_API_KEY:-}" ] && auth=(-H "Authorization: Bearer ${GPULLAMA_API_KEY}")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

check() {  # check NAME EXPECTED_STATUS GREP_PATTERN -- curl args...
  local name="$1" want="$2" pattern="$3"
  shift 4
  local status
  status="$(curl -sS -o "$tmp/body" -w '%{http_code}' --max-time 120 "${auth[@]}" "$@" 2>"$tmp/err")"
  if [ "$status" = "$want" ] && grep -Eq -- "$pattern" "$tmp/body"; then
    passed=$((passed + 1)); echo "PASS $name"
  else
    failed=$((failed + 1)); echo "FAIL $name: status $status (want $want), body: $(head -c 300 "$tmp/body") $(cat "$tmp/err")"
  fi
}

json=(-H "Content-Type: application/json")
chat='{"messages":[{"role":"user","content":"What is the capital of France? Answer with one word."}],"temperature":0,"max_tokens":16}'
completion='{"prompt":"The capital of France is","temperature":0,"max_tokens":4}'

check "health"            200 '"status": ?"ok"'                         -- "$base/health"
check "models"            200 '"object": ?"list".*"id"'                 -- "$base/v1/models"
check "chat"              200 '"chat.completion".*Paris'                -- "${json[@]}" -d "$chat" "$base/v1/chat/completions"
check "completion"        200 '"text_completion".*Paris'                -- "${json[@]}" -d "$completion" "$base/v1/completions"
check "stream"            200 'data: \[DONE\]'                          -- -N "${json[@]}" \
  -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"stream":true}' "$base/v1/chat/completions"
check "malformed JSON"    400 '"error".*"invalid_request_error"'        -- "${json[@]}" -d '{"messages": [' "$base/v1/chat/completions"
check "empty object"      400 '"error".*"messages"'                     -- "${json[@]}" -d '{}' "$base/v1/chat/completions"
check "GET on POST route" 405 '"error"'                                 -- "$base/v1/chat/completions"

# 5 parallel requests, all must answer 200 with a completion
for i in 1 2 3 4 5; do
  curl -sS -o "$tmp/par$i" -w '%{http_code}' --max-time 120 "${auth[@]}" "${json[@]}" \
    -d "{\"prompt\":\"Request $i: the capital of France is\",\"temperature\":0,\"max_tokens\":4}" \
    "$base/v1/completions" >"$tmp/status$i" 2>/dev/null &
done
wait
ok=0
for i in 1 2 3 4 5; do
  [ "$(cat "$tmp/status$i")" = "200" ] && grep -q '"text_completion"' "$tmp/par$i" && ok=$((ok + 1))
done
if [ "$ok" = 5 ]; then passed=$((passed + 1)); echo "PASS 5 parallel requests"
else failed=$((failed + 1)); echo "FAIL 5 parallel requests: $ok of 5 answered"; fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
