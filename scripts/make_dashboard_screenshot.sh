#!/usr/bin/env bash
# Remakes docs/dashboard.png: a TensorBoard dashboard holding a real rope_patch run's --report-to logs. CPU, about a
# minute: the tiny LLaMA of tests/tiny_models.py (native length 64, character tokenizer) fine-tuned 60 steps on a
# repeated phrase (`finetune --report-to tensorboard`), then `eval --report-to tensorboard` of that checkpoint with
# four methods at 32-1,024 tokens on held-out documents; TensorBoard serves both runs on 127.0.0.1 only, headless
# Chromium photographs its Scalars page (loss, and perplexity against length per method), PIL shrinks it.
# Needs chromium (Debian: apt-get install chromium), tensorboard (pip install "rope-patch[trackers]"), and Python's
# websockets and Pillow.
# Usage: scripts/make_dashboard_screenshot.sh [OUT.png] [WORK]   (defaults: docs/dashboard.png, a fresh temp folder)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/dashboard.png}"
WORK="${2:-$(mktemp -d)}"
PYTHON="${PYTHON:-python}"
PORT="${PORT:-6006}"
CDP_PORT="${CDP_PORT:-9223}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The tiny model and its training corpus (6 documents of "the cat sat on mat i. "), and 3 held-out documents.
PYTHONPATH="$PYTHONPATH:$PWD/tests" "$PYTHON" -c "
from pathlib import Path
from tiny_models import write_training_workspace
work = Path('$WORK')
write_training_workspace(work / 'ws', repeats=60)
(work / 'heldout').mkdir()
for i in (6, 7, 8):
    (work / 'heldout' / f'doc{i}.txt').write_text(f'the cat sat on mat {i}. ' * 60)
"
"$PYTHON" -m rope_patch finetune --model "$WORK/ws/tiny" --dataset "$WORK/ws/corpus" --length 64 --steps 60 \
    --warmup-steps 5 --lr 3e-3 --report-to tensorboard --output "$WORK/finetune" --progress off
"$PYTHON" -m rope_patch eval --model "$WORK/finetune" --dataset "$WORK/heldout" --method none \
    --method linear:factor=4 --method ntk:factor=4 --method yarn:factor=4 --lengths 32,64,128,256,512,1024 \
    --documents 3 --report-to tensorboard --output "$WORK/eval" --progress off

"$PYTHON" -m tensorboard.main --logdir "$WORK" --host 127.0.0.1 --port "$PORT" >"$WORK/tensorboard.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 60); do
    curl -sf -o /dev/null "http://127.0.0.1:$PORT/" && break
    sleep 1
done
# The legacy Scalars page draws with SVG (the Time Series page needs WebGL); the tag filter keeps the fine-tune's
# loss and the eval's final table (perplexity/<method> at each length), unsmoothed. "Ignore outliers in chart scaling"
# (on by default, it cuts the longest length off the top) lives in the page's localStorage, not its URL: Chromium is
# driven over its DevTools protocol (127.0.0.1) to set it off, size the page and take the picture.
chromium --headless --no-sandbox --hide-scrollbars --remote-debugging-address=127.0.0.1 \
    --remote-debugging-port="$CDP_PORT" --user-data-dir="$WORK/chromium" about:blank >"$WORK/chromium.log" 2>&1 &
BROWSER=$!
trap 'kill "$SERVER" "$BROWSER" 2>/dev/null || true' EXIT
"$PYTHON" - "$CDP_PORT" "http://127.0.0.1:$PORT" "$OUT" <<'PY'
import base64, io, json, sys, time, urllib.request

from PIL import Image
from websockets.sync.client import connect

port, server, out = sys.argv[1:]
for _ in range(150):
    try:
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json"))
        break
    except OSError:
        time.sleep(0.2)
page = next(t for t in targets if t["type"] == "page")
with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
    ids = iter(range(1, 10**6))

    def call(method, **params):
        n = next(ids)
        ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            message = json.loads(ws.recv())
            if message.get("id") == n:
                return message.get("result", {})

    call("Emulation.setDeviceMetricsOverride", width=1080, height=1110, deviceScaleFactor=1, mobile=False)
    call("Page.navigate", url=f"{server}/")
    time.sleep(3)
    call("Runtime.evaluate", expression="localStorage.setItem('_ignoreYOutliers', 'false')")
    call("Page.navigate", url=f"{server}/#scalars&tagFilter=%5E(loss%7Cperplexity%2F)&_smoothingWeight=0")
    time.sleep(10)  # the charts fetch their series and draw
    png = base64.b64decode(call("Page.captureScreenshot", format="png")["data"])
image = Image.open(io.BytesIO(png)).convert("RGB")
image = image.resize((image.width * 9 // 10, image.height * 9 // 10), Image.LANCZOS)
image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
PY
echo "wrote $OUT ($(stat -c %s "$OUT") bytes); the runs' logs are in $WORK"
