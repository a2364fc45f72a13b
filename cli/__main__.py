from composer.cli.main import main

if __name__ == "__main__":  # the engine workers vLLM spawns (tensor parallelism) import this module again
    main()
