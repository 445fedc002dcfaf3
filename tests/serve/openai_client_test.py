#!/usr/bin/env python3
"""The official `openai` client against `colibri-node --serve` on the embedded model.

A tool-use loop (a named tool_choice makes the model call the tool, the client sends the result
as a `tool` message, the model continues), streamed tool-call deltas assembled as the client
does equal the whole call, 100 sampled json_schema replies at temperature 1 valid by a JSON Schema
validator, logprobs equal to the log-softmax of `--logits-out`'s rows, n = 4 greedy equal to four
single requests, and the thinking block as `reasoning_content`.

    openai_client_test.py --node BIN --model DIR [--np N] [--mpirun 'mpirun|--oversubscribe']

Exits 0 when every check passes, 1 on the first failure, 77 (skipped) when the client packages
are missing.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

try:
    import jsonschema
    import openai
except ImportError as e:
    print(f"skipped: {e.name} is not installed (launch/install-deps.sh sets up the client venv)")
    sys.exit(77)

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "verse": {"type": "integer", "minimum": 1, "maximum": 176},
        "holy": {"type": "boolean"},
        "word": {"type": "string", "maxLength": 12},
    },
    "required": ["answer", "verse", "holy", "word"],
    "additionalProperties": False,
}

PSALM_TOOL = {
    "type": "function",
    "function": {
        "name": "read_psalm",
        "description": "Reads a psalm aloud",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 150}},
            "required": ["number"],
            "additionalProperties": False,
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Jerusalem", "Babylon"]}},
            "required": ["city"],
        },
    },
}


def check(condition, what):
    if not condition:
        raise AssertionError(what)


class Server:
    """`[mpirun -np N] colibri-node --serve --port 0` until stopped; the port from its stderr."""

    def __init__(self, args):
        self.dir = tempfile.mkdtemp(prefix="colibri_client_")
        command = [args.node, "--model", args.model, "--serve", "--port", "0", "--quiet",
                   "--kv-tokens", "16384", "--think", "off"]
        if args.np > 1:
            command = args.mpirun.split("|") + ["-np", str(args.np)] + command
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_rmaps_base_oversubscribe="1",
                   OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
        env.pop("COLIBRI_API_KEY", None)
        self.stderr_path = os.path.join(self.dir, "stderr")
        self.stderr = open(self.stderr_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.stderr,
                                        env=env, start_new_session=True)
        self.port = self.wait_ready(60)

    def log(self):
        with open(self.stderr_path) as f:
            return f.read()

    def wait_ready(self, limit_s):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.log()}")
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", self.log())
            if found:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{found[1]}/health", timeout=2):
                        return int(found[1])
                except OSError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not start within {limit_s} s:\n{self.log()}")

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def tool_use_loop(client):
    """A named tool_choice forces the call; the result goes back; the model continues."""
    messages = [{"role": "user", "content": "Read me the psalm of the shepherd."}]
    first = client.chat.completions.create(
        model="m", messages=messages, tools=[PSALM_TOOL, WEATHER_TOOL], temperature=0,
        max_tokens=100, tool_choice={"type": "function", "function": {"name": "read_psalm"}})
    choice = first.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}: {choice.message}")
    calls = choice.message.tool_calls
    check(calls is not None and len(calls) == 1, f"tool_calls {calls}")
    check(calls[0].function.name == "read_psalm", f"called {calls[0].function.name}")
    number = json.loads(calls[0].function.arguments)["number"]
    check(isinstance(number, int) and 1 <= number <= 150, f"arguments {calls[0].function.arguments}")
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": calls[0].id,
                     "content": "The LORD is my shepherd; I shall not want."})
    second = client.chat.completions.create(model="m", messages=messages,
                                            tools=[PSALM_TOOL, WEATHER_TOOL],
                                            temperature=0, max_tokens=12)
    check(second.choices[0].finish_reason in ("stop", "length"), "the model did not continue")
    check(second.usage.prompt_tokens > first.usage.prompt_tokens,
          "the call and its result are not in the second prompt")
    return calls[0]


def streamed_call_equals_whole(client, whole):
    """Deltas assembled as the client's users do: by index, arguments concatenated."""
    calls = {}
    finish = None
    for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Read me the psalm of the shepherd."}],
            tools=[PSALM_TOOL, WEATHER_TOOL], temperature=0, max_tokens=100, stream=True,
            tool_choice={"type": "function", "function": {"name": "read_psalm"}}):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            if d.function:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    check(finish == "tool_calls", f"streamed finish_reason {finish}")
    check(len(calls) == 1, f"streamed calls {calls}")
    check(calls[0]["name"] == whole.function.name, f"streamed {calls[0]} whole {whole}")
    check(json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments),
          f"streamed {calls[0]['arguments']} whole {whole.function.arguments}")
    check(calls[0]["id"], "a streamed call has no id")


def sampled_schema_replies_are_valid(client, count=100, per_request=10):
    replies = 0
    for request in range(count // per_request):
        response = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Is the LORD my shepherd?"}],
            temperature=1.0, seed=1000 + request * per_request, n=per_request, max_tokens=80,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
        for choice in response.choices:
            check(choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}")
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            replies += 1
    check(replies == count, f"{replies} replies")


def read_npy_f32(path):
    with open(path, "rb") as f:
        check(f.read(6) == b"\x93NUMPY", f"{path} is not .npy")
        major = f.read(2)[0]
        length = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))[0]
        header = eval(f.read(length).decode("latin1"))  # a Python dict literal by the format
        check(header["descr"] == "<f4" and not header["fortran_order"], f"header {header}")
        data = struct.unpack(f"<{math.prod(header['shape'])}f", f.read())
    return header["shape"], data


def logprobs_are_the_log_softmax(client, args):
    prompt = [1000, 200, 3000, 45, 6]
    response = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                         logprobs=2,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = response.choices[0]
    tokens = choice.model_extra["token_ids"]
    with tempfile.TemporaryDirectory() as d:
        npy = os.path.join(d, "logits.npy")
        subprocess.run([args.node, "--model", args.model, "--prompt-ids",
                        ",".join(map(str, prompt)), "--ngen", "6", "--ignore-eos", "--quiet",
                        "--logits-out", npy], check=True, stdout=subprocess.DEVNULL, timeout=120)
        shape, data = read_npy_f32(npy)
    vocab = shape[1]
    for i, token in enumerate(tokens):
        row = data[(len(prompt) - 1 + i) * vocab:(len(prompt) + i) * vocab]
        top = max(row)
        log_total = top + math.log(sum(math.exp(x - top) for x in row))
        got = choice.logprobs.token_logprobs[i]
        check(abs(got - (row[token] - log_total)) <= 1e-5,
              f"token {i}: logprob {got}, log-softmax {row[token] - log_total}")


def n_greedy_equals_single_requests(client):
    messages = [{"role": "user", "content": "And God said,"}]
    four = client.chat.completions.create(model="m", messages=messages, temperature=0, n=4,
                                          max_tokens=12)
    single = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                            max_tokens=12)
    check(len(four.choices) == 4, f"{len(four.choices)} choices")
    for choice in four.choices:
        check(choice.message.content == single.choices[0].message.content,
              f"choice {choice.index}: {choice.message.content!r} vs "
              f"{single.choices[0].message.content!r}")


def reasoning_comes_apart(client):
    """Thinking on: the embedded model never closes the block, so the reply is reasoning."""
    response = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Who made the heaven?"}], temperature=0,
        max_tokens=10, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = response.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    check(reasoning, f"no reasoning_content in {message}")
    check(not message.content, f"content {message.content!r} beside the open thinking block")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--np", type=int, default=1)
    parser.add_argument("--mpirun", default="mpirun|--oversubscribe")
    args = parser.parse_args()
    server = Server(args)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                               timeout=120, max_retries=0)
        call = None
        for name, run in [
            ("tool-use loop", lambda: tool_use_loop(client)),
            ("streamed call equals whole", lambda: streamed_call_equals_whole(client, call)),
            ("100 sampled json_schema replies valid", lambda: sampled_schema_replies_are_valid(client)),
            ("logprobs are the log-softmax of --logits-out", lambda: logprobs_are_the_log_softmax(client, args)),
            ("n=4 greedy equals single requests", lambda: n_greedy_equals_single_requests(client)),
            ("reasoning_content", lambda: reasoning_comes_apart(client)),
        ]:
            start = time.monotonic()
            result = run()
            if name == "tool-use loop":
                call = result
            print(f"ok   {name} ({time.monotonic() - start:.1f} s, np {args.np})", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported with the server's log
        print(f"FAIL {type(e).__name__}: {e}\n--- server stderr ---\n{server.log()}")
        server.stop()
        return 1
    server.stop()
    print(f"openai {openai.__version__}: all checks passed at np {args.np}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
