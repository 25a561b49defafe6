import time, sys, openai
c = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="x")
model = c.models.list().data[0].id
msgs = [{"role": "user", "content": "Write a long story about a robot who learns to paint. " * 20}]
for rep in range(3):
    t0 = time.perf_counter(); times = []
    s = c.chat.completions.create(model=model, messages=msgs, max_tokens=200, temperature=0, stream=True, stream_options={"include_usage": True})
    n = 0
    for ch in s:
        if ch.usage: n = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].delta.content: times.append(time.perf_counter())
    ttft = times[0] - t0
    print(f"ttft {ttft*1e3:.0f} ms, {n} tokens, gen {(n-1)/(times[-1]-times[0]):.1f} tok/s, chunks {len(times)}")
