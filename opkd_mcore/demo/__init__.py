"""`opkd demo`: synthetic tasks, the teacher's supervised training, evaluation and plots."""
