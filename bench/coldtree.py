"""A conversation read from the store: `record N` makes a conversation of N
messages (one view, without calling the model) and keeps its id in
$WORK/coldtree.id; `read` times 15 reads each of its whole tree and of its
active path (GET /v1/conversations/{id}, ?path=1) and prints p50 and min.
Driven by bench/coldtree.sh, which restarts Arbor between the two so that
nothing of the conversation is in memory."""
import json
import os
import sys
import time

import arbor_api


def main(mode, work, messages=0):
    call = arbor_api.client()

    id_file = os.path.join(work, "coldtree.id")
    if mode == "record":
        conversation = json.loads(call("POST", "/v1/conversations", {}))["id"]
        view = [
            {"role": "user" if turn % 2 == 0 else "assistant", "content": f"message {turn}: a line of ordinary chat text"}
            for turn in range(messages)
        ]
        call("POST", f"/v1/conversations/{conversation}/messages", {"messages": view, "run": False})
        with open(id_file, "w") as out:
            out.write(conversation)
        return
    conversation = open(id_file).read()
    for path, label in ((f"/v1/conversations/{conversation}", "tree"), (f"/v1/conversations/{conversation}?path=1", "path")):
        times = []
        for _ in range(15):
            started = time.perf_counter()
            body = call("GET", path)
            times.append((time.perf_counter() - started) * 1000)
        times.sort()
        print(f"{label} ({len(body)} bytes) p50 {times[len(times) // 2]:.2f} ms, min {times[0]:.2f} ms", end="; ")
    print()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
