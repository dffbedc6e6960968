"""Answer checkers: math answers (extraction, symbolic equality) and the code grader's programs; no other ptx."""
