import time, sys, openai
c = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="x")
model = c.models.list().data[0].id
msgs = [{"role": "user", "content": "Write a long story about a robot who learns to paint. " * 20}]
for mt in (1, 201, 1, 201):
    t0 = time.perf_counter()
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=mt, temperature=0)
    print(mt, r.usage.completion_tokens, f"{(time.perf_counter()-t0)*1e3:.0f} ms")
