// Lint of the TypeScript front end (npm run lint; the Python tests run it).
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['lib/', 'build/', 'node_modules/', 'elastic_jupyter/'] },
  ...tseslint.configs.recommended,
  {
    files: ['labextension/**/*.ts'],
    rules: {
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-non-null-assertion': 'off',
      eqeqeq: 'error',
      curly: 'error',
      'prefer-const': 'error'
    }
  }
);
