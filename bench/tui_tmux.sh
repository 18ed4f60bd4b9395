#!/usr/bin/env bash
# Drive `mtplx tui` for real in tmux on the embedded model and capture its screens:
#   1. a chat turn streams, then three messages sent back to back queue and are answered in order;
#   2. an external request (curl) to the background endpoint shows up in the turns, in-flight and
#      bank panels;  3. drill-down: enter on the newest turn, then the receipts screen and one
#      receipt;  4. a replay of a sample transcript restores its warm turns;  5. the dashboard and
#      the help modal at 80x24;  6. attach mode: `mtplx tui --attach URL/v1 --api-key K` follows
#      a `mtplx serve --api-key K` (an agent's turn and its bank entry), shows the reconnect
#      countdown when the server stops, and connects again after it restarts.
# Usage: bash bench/tui_tmux.sh [OUT_DIR]   (needs tmux and curl; ~4 minutes on 2 cores)
set -euo pipefail
OUT=${1:-logs/tui-captures}
PORT=${PORT:-8095}
PORT2=${PORT2:-8096}
KEY=tmux-key
mkdir -p "$OUT"
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
export MTPLX_HOME=$(mktemp -d)
S=mtplx-capture
tmux kill-session -t $S 2>/dev/null || true
tmux new-session -d -s $S -x 150 -y 42 "mtplx tui --port $PORT"
cleanup() { tmux kill-session -t $S 2>/dev/null || true; }
trap cleanup EXIT
cap() { tmux capture-pane -p -t "${2:-$S}" > "$OUT/$1.txt"; echo "captured $OUT/$1.txt"; }
wait_for() {  # wait until the screen (of pane $3, default the TUI) shows $1 (up to $2 seconds)
  for _ in $(seq 1 $(( $2 * 2 ))); do tmux capture-pane -p -t "${3:-$S}" | grep -q -- "$1" && return 0; sleep 0.5; done
  echo "timed out waiting for: $1" >&2; tmux capture-pane -p -t "${3:-$S}" >&2; return 1
}
wait_gone() {  # wait until the screen no longer shows $1
  for _ in $(seq 1 $(( $2 * 2 ))); do tmux capture-pane -p -t $S | grep -q -- "$1" || return 0; sleep 0.5; done
  echo "timed out waiting for '$1' to go" >&2; return 1
}
wait_for "endpoint http://127.0.0.1:$PORT" 60

# 1. chat: type, send, capture while streaming and when done; then three rapid sends
tmux send-keys -t $S "Explain what src/ledger/events.py does" Enter
sleep 0.4; cap 01-chat-streaming
wait_for "done:" 120; cap 02-chat-done
# as fast as the box takes them: the next one as soon as the box is empty again, while the first
# reply still generates (keys arriving in one read, e.g. on a loaded machine, count as a paste)
for m in "First, list the files." "Then read the tests." "Finally, summarise."; do
  tmux send-keys -t $S "$m"; sleep 0.05; tmux send-keys -t $S Enter; wait_for "Message the model" 10
done
sleep 0.3; cap 03-chat-three-sends-queued
wait_gone "queued" 180; wait_for "▌ 4 " 120; sleep 1; cap 04-chat-three-answered-in-order

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
sleep 1.0; cap 05-external-in-flight
wait; sleep 2; cap 06-external-done

# 3. drill-down: the newest turn, then the receipts screen and its newest receipt
tmux send-keys -t $S F4; sleep 0.3; tmux send-keys -t $S Enter
wait_for "id: r" 20; cap 07-turn-drill-down
tmux send-keys -t $S Escape; sleep 0.5; tmux send-keys -t $S F3
wait_for "finish" 20; sleep 0.5; cap 08-receipts
tmux send-keys -t $S Enter; wait_for "^ *receipt r" 20; cap 09-receipt-drill-down
tmux send-keys -t $S Escape; sleep 0.3; tmux send-keys -t $S Escape; sleep 0.5

# 4. replay: f2, pick reasoning_stripped, run all turns
tmux send-keys -t $S F2; sleep 1
for _ in $(seq 1 4); do tmux send-keys -t $S Down; done  # the 5th transcript: reasoning_stripped
tmux send-keys -t $S Enter; sleep 0.5
tmux send-keys -t $S n; wait_for "turn 1/" 120; cap 10-replay-first-turn
tmux send-keys -t $S a; wait_for "turn 7/7 done" 300; cap 11-replay-done
tmux send-keys -t $S Escape; sleep 1.5; cap 12-dashboard-after

# 5. a small terminal: every key number of the newest turns, and the help modal fitting
tmux resize-window -t $S -x 80 -y 24; sleep 1.5; cap 13-dashboard-80x24
tmux send-keys -t $S F1; sleep 0.8; cap 14-help-80x24
tmux send-keys -t $S Escape; sleep 0.3
tmux resize-window -t $S -x 150 -y 42; sleep 0.5

tmux send-keys -t $S C-q; sleep 3
if curl -s -m 2 "http://127.0.0.1:$PORT/v1/models" >/dev/null; then echo "server still answering after quit" >&2; exit 1; fi
echo "quit: server stopped"

# 6. attach mode against a headless server with an API key, across a restart
A=mtplx-capture-attach
serve() { mtplx serve --port $PORT2 --api-key $KEY > "$OUT/serve-$1.log" 2>&1 & SERVE=$!; }
healthy() { for _ in $(seq 1 240); do curl -s -m 1 "http://127.0.0.1:$PORT2/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
serve 1; healthy
trap 'cleanup; tmux kill-session -t $A 2>/dev/null || true; kill $SERVE 2>/dev/null || true' EXIT
tmux kill-session -t $A 2>/dev/null || true
tmux new-session -d -s $A -x 150 -y 42 "mtplx tui --attach http://127.0.0.1:$PORT2/v1 --api-key $KEY"
wait_for "· connected" 60 $A; cap 15-attach-connected $A
curl -s "http://127.0.0.1:$PORT2/v1/chat/completions" -H 'content-type: application/json' -H "authorization: Bearer $KEY" \
  -H 'x-session-id: attached-agent' -d @"$OUT/curl-body.json" > "$OUT/attach-response.json"
sleep 2; cap 16-attach-turn-and-bank $A
kill -INT $SERVE; wait $SERVE || true
wait_for "reconnecting in" 30 $A; cap 17-attach-server-stopped $A
serve 2; healthy
wait_for "· connected" 120 $A; cap 18-attach-reconnected $A
tmux send-keys -t $A C-q; sleep 2
kill -INT $SERVE; wait $SERVE || true
echo "attach: followed, reconnected"
