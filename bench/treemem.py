"""Long conversations gone quiet: records CONVERSATIONS conversations of
MESSAGES messages each (one view each, without calling the model), runs one
JSON turn in each (so that its tree is read into memory as a turn does),
and prints Arbor's RSS, peak RSS and the `/metrics` gauges of conversations
loaded and the bytes they hold, after every tenth conversation and at the
end. Used by bench/treemem.sh.

    python3 bench/treemem.py BASE_URL PID CONVERSATIONS MESSAGES
"""

import json
import sys
import time

import arbor_api


def main(base_url, pid, conversations, messages):
    call = arbor_api.client(base_url)

    def status(label):
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        metrics = call("GET", "/metrics").decode()
        gauge = lambda name: next((line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")), None)
        held = gauge("arbor_conversations_bytes")
        print(
            f"{label}: rss {int(fields['VmRSS'].split()[0]) / 1024:.1f} MiB, "
            f"peak {int(fields['VmHWM'].split()[0]) / 1024:.1f} MiB, "
            f"conversations loaded {gauge('arbor_conversations_loaded')}, "
            "held " + (f"{int(held) / 2**20:.1f} MiB" if held else "(not counted by this build)"),
            flush=True,
        )

    started = time.monotonic()
    for index in range(conversations):
        conversation = json.loads(call("POST", "/v1/conversations", {}))["id"]
        view = [
            {"role": "user" if turn % 2 == 0 else "assistant", "content": f"message {turn}: a line of ordinary chat text"}
            for turn in range(messages)
        ]
        call("POST", f"/v1/conversations/{conversation}/messages", {"messages": view, "run": False})
        call("POST", f"/v1/conversations/{conversation}/messages", {"content": "and one more question"})
        if (index + 1) % 10 == 0:
            status(f"{index + 1} conversations")
    print(f"recorded {conversations} x {messages} messages in {time.monotonic() - started:.1f} s")
    status("at the end")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
