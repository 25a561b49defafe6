import time, torch, threading, os
from sluice import LLM, SamplingParams
llm = LLM(None)
tok = llm.engine.tokenizer
msgs = [{"role": "user", "content": "Write a long story about a robot who learns to paint. " * 20}]
ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
eng = llm.engine
def run(tag):
    for mt in (1, 201):
        t = time.perf_counter()
        eng.add_request(f"r{mt}{time.time()}", ids, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True))
        while eng.has_unfinished(): eng.step()
        print(tag, mt, f"{(time.perf_counter()-t)*1e3:.0f} ms", torch.get_num_threads(), flush=True)
run("main")
th = threading.Thread(target=run, args=("thread",)); th.start(); th.join()
run("main")
th = threading.Thread(target=run, args=("thread",)); th.start(); th.join()
