#!/bin/bash
# run.sh NAME SEED extra args...
name=$1; seed=$2; shift 2
cd /work/main && .venv/bin/python benchmarks/engine_replay.py --workflows 96 --concurrency 32 --history actual --admission load --speculative-config '{"method": "ngram"}' --virtual-clock --step-cost 0.141,0.070,0.321,1.204,11.4 --threads 1 --seed $seed "$@" > /tmp/vc/$name-s$seed.txt 2>&1
