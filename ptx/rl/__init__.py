"""Host-side RL: sandbox, scheduler, environments and verifiers, host rewards, evaluation."""
