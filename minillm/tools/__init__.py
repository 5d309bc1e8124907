"""The tools around the chapters: nothing in the chapters' modules imports them.

    cli          python -m minillm ... (every command below is a subcommand)
    demo         the main demo: the real model answers, the character model speculates
    chat_cli     python -m minillm chat
    medusa_cli   python -m minillm medusa-train
    benchmarks/  one benchmark per chapter: python -m minillm bench TOPIC
    course       the course kit: student editions and grading
    gpu_check    every GPU check and benchmark in one command: python -m minillm.tools.gpu_check
    options      argparse types that refuse bad numbers (NaN, out of range) with one line
    project      where the project's checkout is; running its tests
"""
