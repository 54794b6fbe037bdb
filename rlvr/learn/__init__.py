"""What changes the weights: the step (step.py) over the forward pass (forward.py) and the batch's tensors
(batch.py), the Learner it takes (learner.py), weights sharded across learners (sharding.py), PPO's update with a
critic (ppo.py). Nothing here opens a run, reads a file or knows a batch source."""
