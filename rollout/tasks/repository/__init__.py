"""Repository tasks, a room of their own: real projects with their test suites (`projects`), the changes the agent
must undo or complete (`mutations`, `history`, `candidates`), the build that validates them into a task set (`build`,
`surveys`) and the built set (`task_set`); an episode's copy-on-write view and its guarded grading (`workspace`,
`grading_policy`, `pytest_report`), and the same on the fleet's remote hosts (`shipping`, `remote`)."""
