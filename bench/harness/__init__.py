"""The applications that drive engines and drafters over a trace: the replay of a recorded run (the
main job, ``bench.harness.cli``) and the simulator that schedules the same steps from recorded tokens
alone, with the checks that hold the two equal."""
