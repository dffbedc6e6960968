"""Host-side RL: sandbox, scheduler, environments and verifiers, evaluation."""
