"""The closed loop: train the bundled GRPO task with each method's rollouts and compare what is learnt.

    python -m bench.train -m          the default sweep (conf/train.yaml): method x lenience x seed
    python -m bench.train.report      reward curves, final-reward table, step time, KL

Exact methods must train bit-identical weights to the baseline (float64, tested); SPEC-RL's ratio
rule at each lenience shows whether its bias changes the reward curve (see ``report``).
"""
