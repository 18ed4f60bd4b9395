#!/usr/bin/env bash
# Drive `mtplx tui` for real in tmux on the embedded model and capture its screens:
#   1. a chat turn streams;  2. an external request (curl) to the background endpoint shows up in
#   the turns and requests panels;  3. a replay of a sample transcript restores its warm turns;
#   4. the dashboard afterwards (bank entries, anchor map of the selected entry).
# Usage: bash bench/tui_tmux.sh [OUT_DIR]   (needs tmux and curl; ~2 minutes on 2 cores)
set -euo pipefail
OUT=${1:-logs/tui-captures}
PORT=${PORT:-8095}
mkdir -p "$OUT"
export MTPLX_HOME=$(mktemp -d)
S=mtplx-capture
tmux kill-session -t $S 2>/dev/null || true
tmux new-session -d -s $S -x 150 -y 42 "mtplx tui --port $PORT"
cleanup() { tmux kill-session -t $S 2>/dev/null || true; }
trap cleanup EXIT
cap() { tmux capture-pane -p -t $S > "$OUT/$1.txt"; echo "captured $OUT/$1.txt"; }
wait_for() {  # wait until the screen shows $1 (up to $2 seconds)
  for _ in $(seq 1 $(( $2 * 2 ))); do tmux capture-pane -p -t $S | grep -q -- "$1" && return 0; sleep 0.5; done
  echo "timed out waiting for: $1" >&2; tmux capture-pane -p -t $S >&2; return 1
}
wait_for "endpoint http://127.0.0.1:$PORT" 60

# 1. chat: type, send, capture while streaming and when done
tmux send-keys -t $S "Explain what src/ledger/events.py does" Enter
sleep 0.4; cap 1-chat-streaming
wait_for "done:" 120; cap 2-chat-done

# 2. an external agent's request, while the TUI runs
# (a long file in the message, so its prefill is long enough to watch in the requests panel)
python - > "$OUT/curl-body.json" <<'PY'
import json, pathlib
code = pathlib.Path("mtplx/bank/bank.py").read_text()[:9000]
print(json.dumps({"messages": [{"role": "system", "content": "You are a coding agent."},
                               {"role": "user", "content": "Review this file:\n\n" + code}], "max_tokens": 48}))
PY
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -H 'x-session-id: curl-agent' -d @"$OUT/curl-body.json" > "$OUT/curl-response.json" &
sleep 1.0; cap 3-external-in-flight
wait; sleep 1; cap 4-external-done

# 3. replay: f2, pick reasoning_stripped, run all turns
tmux send-keys -t $S F2; sleep 1
for _ in $(seq 1 4); do tmux send-keys -t $S Down; done  # the 5th transcript: reasoning_stripped
tmux send-keys -t $S Enter; sleep 0.5
tmux send-keys -t $S n; wait_for "turn 1/" 120; cap 5-replay-first-turn
tmux send-keys -t $S a; wait_for "turn 7/7 done" 300; cap 6-replay-done

# 4. back to the dashboard: bank entries and the anchor map of the most recent entry
tmux send-keys -t $S Escape; sleep 1.5; cap 7-dashboard-after

tmux send-keys -t $S C-q; sleep 3
if curl -s -m 2 "http://127.0.0.1:$PORT/v1/models" >/dev/null; then echo "server still answering after quit" >&2; exit 1; fi
echo "quit: server stopped"
