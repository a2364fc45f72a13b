"""The RL driver: where rollout (vLLM, environments), the learner (Megatron) and sync meet."""
